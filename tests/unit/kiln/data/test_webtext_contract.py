"""``web-text@1`` end to end on natural-language shards: each poison kind caught by exactly its rule, no
healthy shard quarantined, dropped documents reported (JSON, HTML) and left out of training."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kiln.data.contracts import load_contract
from kiln.data.doc_rules import build_rule_set
from kiln.data.poison_text import POISONED_SHARE, TEXT_POISON_KINDS
from kiln.data.validation import (
    DROPPED_SHARE_RULE,
    build_training_manifest,
    drop_rows,
    render_quarantine_html,
    validate_directory,
    write_quarantine_report,
)
from kiln.refs import ShardReport, TrainingManifest
from kiln_trainer.errors import ShardIntegrityError

from webtext_fixtures import poisoned, prose_documents, split, table, write_corpus

HEALTHY_SHARDS = 6
KINDS = tuple(TEXT_POISON_KINDS)


@pytest.fixture(scope="module")
def contract():
    return load_contract("web-text@1")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, contract) -> dict[str, Any]:
    """Six healthy shards of prose, then one shard per poison kind (40 documents each), validated once."""
    import pyarrow as pa

    parts = split(prose_documents(), HEALTHY_SHARDS + 2)
    healthy, spare = parts[:HEALTHY_SHARDS], parts[HEALTHY_SHARDS] + parts[HEALTHY_SHARDS + 1]
    rules = build_rule_set(contract.document_rules)
    donors = []
    for part in healthy:  # copies of documents the rules keep: only the near-duplicate rule can drop them
        dropped = {d.row for d in rules.judge(pa.array([text for _, text, _ in part]))}
        donors.extend(doc for i, doc in enumerate(part) if i not in dropped)
    base = [(f"{i}", text, source) for i, (_, text, source) in enumerate(spare[:40])]
    poisons = {}
    for kind in KINDS:
        docs = [(f"{kind}-{doc_id}", text, source) for doc_id, text, source in base]
        poisons[kind] = (docs, poisoned(kind, docs, donors=donors if kind == "near_duplicates" else ()))
    out = tmp_path_factory.mktemp("webtext") / "corpus"
    paths = write_corpus(out, [*healthy, *(p[1] for p in poisons.values())])
    reports = validate_directory(out, contract)
    return {"out": out, "paths": paths, "reports": reports, "poisons": poisons}


def _report(corpus: dict[str, Any], index: int) -> ShardReport:
    return next(r for r in corpus["reports"] if r.path == str(corpus["paths"][index].resolve()))


def test_each_poison_kind_is_caught_by_exactly_its_rule_and_no_healthy_shard_is_quarantined(corpus, contract) -> None:
    for i in range(HEALTHY_SHARDS):
        report = _report(corpus, i)
        assert report.verdict == "healthy", (i, report.reasons, report.dropped)
        assert report.dropped is not None and report.dropped["share"] <= contract.max_dropped_share
    for n, kind in enumerate(KINDS):
        report = _report(corpus, HEALTHY_SHARDS + n)
        rule = TEXT_POISON_KINDS[kind].rule
        assert report.verdict == "quarantined", kind
        assert [r["expectation"] for r in report.reasons] == [DROPPED_SHARE_RULE], (kind, report.reasons)
        by_rule = report.reasons[0]["by_rule"]
        assert max(by_rule, key=by_rule.get) == rule, (kind, by_rule)
        # Every poisoned document is dropped, and by the poison's rule (a rule's drops are at least the poisoned ones).
        clean, dirty = corpus["poisons"][kind]
        touched = [i for i, (a, b) in enumerate(zip(clean, dirty, strict=True)) if a[1] != b[1]]
        assert len(touched) == round(POISONED_SHARE * len(clean))
        assert set(touched) <= set(drop_rows(report)), kind
        assert by_rule[rule] >= len(touched), (kind, by_rule)
        # ...and no other poison's rule fires on this shard beyond what the clean text already drops.
        for other in KINDS:
            other_rule = TEXT_POISON_KINDS[other].rule
            if other_rule != rule:
                assert by_rule.get(other_rule, 0) <= 3, (kind, other, by_rule)


def test_dropped_documents_are_named_by_rule_and_pii_samples_never_show_what_they_found(corpus) -> None:
    pii = _report(corpus, HEALTHY_SHARDS + KINDS.index("pii"))
    entry = pii.dropped["rules"]["pii"]
    assert set(entry["details"]) == {"email", "phone", "public_ip"} and entry["count"] == sum(entry["details"].values())
    assert entry["sample"] and all(re.fullmatch(r"pii-\d+ \((email|phone|public_ip)\)", s) for s in entry["sample"])
    wire = json.dumps(pii.to_json())
    assert not re.search(r"@mailbox-|\+1 415 \d|server answered from \d", wire)
    near = _report(corpus, HEALTHY_SHARDS + KINDS.index("near_duplicates"))
    sample = near.dropped["rules"]["near_duplicate"]["sample"][0]
    assert re.search(r"≈ .+ in shard-0000[0-5]\.parquet \(Jaccard ≈ (0\.[89]\d|1\.00)\)", sample), sample
    spam = _report(corpus, HEALTHY_SHARDS + KINDS.index("spam"))
    assert spam.dropped["rules"]["gopher_quality"]["details"].get("gopher_enough_stop_words", 0) >= 30
    assert ShardReport.from_json(json.loads(json.dumps(spam.to_json()))) == spam


def test_quarantine_report_shows_dropped_documents_by_reason_and_shard_verdicts(corpus, contract, tmp_path: Path) -> None:
    path = write_quarantine_report(corpus["reports"], tmp_path / "q.json", snapshot_id="s.dir", max_quarantine_share=0.5,
                                   contract=contract)
    body = json.loads(path.read_text())
    healthy = body["dropped"]["healthy_shards"]
    assert body["healthy"] == HEALTHY_SHARDS and len(body["quarantined"]) == len(KINDS)
    assert healthy["documents"] == sum(len(drop_rows(r)) for r in corpus["reports"] if r.verdict == "healthy")
    assert healthy["documents"] == sum(healthy["by_rule"].values()) > 0
    everywhere = body["dropped"]["all_shards"]["by_rule"]
    assert {TEXT_POISON_KINDS[k].rule for k in KINDS} <= set(everywhere)
    page = render_quarantine_html(corpus["reports"], snapshot_id="s.dir", max_quarantine_share=0.5, contract=contract)
    assert page.count("<tr class='quarantined'>") == len(KINDS) and page.count("<tr class='healthy'>") == HEALTHY_SHARDS
    assert "Documents dropped:" in page and "documents dropped</th>" in page
    for rule in contract.document_rules:
        assert f"<code>{rule['rule']}</code>" in page
    assert "<code>near_duplicate</code>" in page and DROPPED_SHARE_RULE in page
    assert not re.search(r"[\w.]+@mailbox-", page)


def test_manifest_lists_drop_rows_and_only_kept_documents_reach_tokenizing(corpus, contract, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    manifest = build_training_manifest("s.dir", "webtext", contract, corpus["reports"])
    assert len(manifest.shards) == HEALTHY_SHARDS
    healthy = {r.path: r for r in corpus["reports"] if r.verdict == "healthy"}
    for entry in manifest.shards:
        assert entry["drop_rows"] == drop_rows(healthy[entry["path"]]) and entry["drop_rows"]
    texts = list(_kept_texts(manifest.shards))
    expected = []
    for entry in manifest.shards:
        column = pq.read_table(entry["path"], columns=["text"]).column("text").to_pylist()
        expected.extend(t for i, t in enumerate(column) if i not in set(entry["drop_rows"]))
    assert texts == expected and len(texts) == sum(e["rows"] - len(e["drop_rows"]) for e in manifest.shards)
    # The drop lists are part of the manifest's hash: another drop list is another manifest.
    fewer = [dict(e, drop_rows=e["drop_rows"][1:]) for e in manifest.shards]
    body = {k: v for k, v in manifest.to_json().items() if k not in ("kind", "sha256")}
    assert TrainingManifest.build(**{**body, "shards": fewer}).sha256 != manifest.sha256
    # The trainer reads the same manifest the same way (its rank 0 packs a manifest without tokens).
    from kiln_trainer.packed import iter_training_texts
    from kiln_trainer.training_manifest import load_training_manifest

    trainer_view = load_training_manifest(manifest.write(tmp_path / "m.json"))
    assert [e.drop_rows for e in trainer_view.shards] == [tuple(e["drop_rows"]) for e in manifest.shards]
    assert list(iter_training_texts(trainer_view.shards)) == expected


def _kept_texts(shards):
    from kiln.stages.tokenize import _texts

    return _texts(shards)


@pytest.mark.parametrize(("drop_rows", "named"), [([3, 1], "ascending"), ([1, 1], "unique"), ([10**9], r"within \[0,"),
                                                  ([True], "list of row numbers"), ("1", "list of row numbers")])
def test_the_trainer_refuses_a_drop_list_that_is_not_rows_of_its_shard(corpus, contract, tmp_path: Path, drop_rows,
                                                                       named) -> None:
    import hashlib

    from kiln.refs import canonical_json
    from kiln_trainer.errors import TrainingManifestError
    from kiln_trainer.training_manifest import load_training_manifest

    body = {k: v for k, v in build_training_manifest("s.dir", "webtext", contract, corpus["reports"]).to_json().items()
            if k not in ("kind", "sha256")}
    body["shards"] = [dict(body["shards"][0], drop_rows=drop_rows), *body["shards"][1:]]
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"kind": "kiln.TrainingManifest", **body,
                                "sha256": hashlib.sha256(canonical_json(body)).hexdigest()}))
    with pytest.raises(TrainingManifestError, match=rf"shards\[0\]\.drop_rows must be .*{named}"):
        load_training_manifest(path)


def test_a_shard_changed_after_validation_is_refused_when_its_texts_are_read(corpus, contract, tmp_path: Path) -> None:
    manifest = build_training_manifest("s.dir", "webtext", contract, corpus["reports"])
    moved = tmp_path / "shard.parquet"
    moved.write_bytes(Path(manifest.shards[0]["path"]).read_bytes() + b"x")
    with pytest.raises(ShardIntegrityError, match="sha256 mismatch"):
        list(_kept_texts([dict(manifest.shards[0], path=str(moved))]))


def test_a_contract_without_document_rules_reports_exactly_as_before(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from kiln.data.validation import validate_shard

    path = tmp_path / "shard.parquet"
    pq.write_table(table(prose_documents()[:5]), path)
    report = validate_shard(path, "stdlib-py@1")
    assert report.dropped is None and "dropped" not in report.to_json()
    manifest = build_training_manifest("s.dir", "c", "stdlib-py@1", [report])
    assert "drop_rows" not in manifest.shards[0]


def test_tokenize_stage_reads_only_kept_rows_and_addresses_them_apart(corpus, contract, tmp_path: Path, capsys) -> None:
    from kiln.cli import main
    from kiln.stages.tokenize import _shard_set, _texts
    from kiln_trainer.packed import iter_training_texts
    from kiln_trainer.training_manifest import ShardEntry

    manifest = build_training_manifest("s.dir", "webtext", contract, corpus["reports"])
    kept = list(_texts(manifest.shards))
    assert len(kept) == sum(e["rows"] - len(e["drop_rows"]) for e in manifest.shards)
    body = {k: v for k, v in manifest.to_json().items() if k not in ("kind", "sha256")}
    everything = TrainingManifest.build(**{**body, "shards": [{k: v for k, v in e.items() if k != "drop_rows"}
                                                             for e in manifest.shards]})
    entries = [ShardEntry(path=e["path"], sha256=e["sha256"], rows=e["rows"]) for e in everything.shards]
    assert list(_texts(everything.shards)) == list(iter_training_texts(entries))  # no drop list: the trainer's reader
    assert _shard_set(everything) != _shard_set(manifest)
    # kiln tokenize packs with the trainer's packer, which leaves the dropped rows out too.
    path = manifest.write(tmp_path / "m.json")
    assert main(["tokenize", "--recipe", "tiny", "--manifest", str(path), "--out", str(tmp_path / "tokens")]) == 0
    assert json.loads(capsys.readouterr().out)["documents"] == len(kept)


def test_kiln_validate_on_web_text_reports_dropped_documents_and_writes_drop_lists(corpus, tmp_path: Path, capsys) -> None:
    from kiln.cli import main

    report, manifest = tmp_path / "r.json", tmp_path / "m.json"
    argv = ["validate", str(corpus["out"]), "--contract", "web-text@1", "--report", str(report), "--manifest-out",
            str(manifest), "--max-quarantine-share", "0.5"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["healthy"] == HEALTHY_SHARDS and len(summary["quarantined"]) == len(KINDS)
    dropped = summary["documents_dropped"]
    assert dropped["documents"] == sum(dropped["by_rule"].values()) > 0
    assert json.loads(report.read_text())["dropped"]["healthy_shards"]["documents"] == dropped["documents"]
    written = TrainingManifest.read(manifest)
    assert sum(len(e["drop_rows"]) for e in written.shards) == dropped["documents"]

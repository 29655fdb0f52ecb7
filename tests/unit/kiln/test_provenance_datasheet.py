"""The datasheet made from a signed provenance statement: what it says about the data, its cleaning, the
training, the evaluation and the approval, from which source; sources bound by digest are used only
with the signed digest; every value is escaped in both renderings."""

from __future__ import annotations

import hashlib
import os
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Literal

import pytest
from provenance_fixtures import inputs, make_artifact

from kiln.data.contracts import load_contract
from kiln.data.corpora import CorpusMetadata, SplitStats
from kiln.data.validation.report import quarantine_report, quarantine_report_text
from kiln.errors import ProvenanceError
from kiln.provenance.datasheet import (
    DatasheetSources,
    approval_tags,
    build_datasheet,
    datasheet_html,
    datasheet_markdown,
    render,
)
from kiln.provenance.datasheet_sources import local_sources
from kiln.provenance.statement import build_statement
from kiln.refs import ShardReport

SNAPSHOT = "/kiln/snapshots/0123456789abcdef0123456789abcdef"
RECIPE = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
          "data": {"global_batch_size": 8, "micro_batch_size": 8},
          "optim": {"lr": 0.001, "warmup_steps": 20}, "train": {"steps": 24, "seed": 1337, "device": "cpu",
                                                              "dtype": "float32"},
          "parallel": {"strategy": "ddp"}}


def _shard(name: str, verdict: Literal["healthy", "quarantined"], rows: int, reasons: list[dict[str, Any]] | None = None,
           dropped: dict[str, Any] | None = None) -> ShardReport:
    return ShardReport(path=f"{SNAPSHOT}/train/{name}", sha256=hashlib.sha256(name.encode()).hexdigest(), rows=rows,
                       verdict=verdict, reasons=reasons or [], contract="web-text@1", dropped=dropped)


def _report_bytes(contract: Any) -> bytes:
    """A quarantine report as the data gate writes it (kiln's own writer): an exact eval copy, a shard
    over the dropped-share limit, and healthy shards with dropped documents and near-duplicates."""
    reports = [
        _shard("shard-00000.parquet", "healthy", 40, dropped={"rows": [1, 4, 9], "share": 0.075, "rules": {
            "c4_quality": {"count": 2, "details": {"too_few_sentences": 2}, "sample": []},
            "near_duplicate": {"count": 1, "details": {"eval_split": 1}, "sample": []}}}),
        _shard("shard-00001.parquet", "healthy", 40, dropped={"rows": [2, 3], "share": 0.05, "rules": {
            "near_duplicate": {"count": 2, "details": {"near_duplicate": 2}, "sample": []}}}),
        _shard("shard-00002.parquet", "quarantined", 42, reasons=[
            {"expectation": "expect_column_values_to_be_in_set", "column": "kiln_text_in_eval_split",
             "unexpected_count": 2, "sample": ["evalcopy-0: True", "evalcopy-1: True"]}], dropped={
            "rows": [], "share": 0.0, "rules": {}}),
        _shard("shard-00003.parquet", "quarantined", 40, reasons=[
            {"expectation": "max_dropped_share", "column": "text", "unexpected_count": 32,
             "by_rule": {"pii": 30, "c4_quality": 2}, "sample": ["32 of 40 documents dropped"]}], dropped={
            "rows": list(range(32)), "share": 0.8, "rules": {
                "pii": {"count": 30, "details": {"email": 10, "phone": 10, "public_ip": 10}, "sample": []},
                "c4_quality": {"count": 2, "details": {"too_few_sentences": 2}, "sample": []}}}),
    ]
    body = quarantine_report(reports, snapshot_id="0123456789abcdef0123456789abcdef.dir", max_quarantine_share=0.5,
                             contract=contract)
    return quarantine_report_text(body).encode("utf-8")


def _corpus_json(name: str = "imported") -> bytes:
    return CorpusMetadata(kind="natural-language", contract="web-text@1", producer="kiln corpus import",
                          source={"format": "jsonl", "input": f"{name}.jsonl.gz", "files": 1, "text_field": "text"},
                          split={"rule": "keyed blake2b-64 of the text", "seed": 0, "eval_fraction": 0.05},
                          train=SplitStats(shards=4, documents=162, text_bytes=180_000),
                          eval=SplitStats(shards=1, documents=10, text_bytes=9_000)).to_bytes()


@pytest.fixture(scope="module")
def web_text() -> Any:
    return load_contract("web-text@1")


def _statement(tmp_path: Path, contract: Any, report: bytes, **changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "contract": "web-text@1", "contract_suite_sha256": contract.sha256, "corpus": "webtext",
        "quarantine_report_sha256": hashlib.sha256(report).hexdigest(), "snapshot_path": SNAPSHOT,
        "max_quarantine_share": 0.5, "recipe": RECIPE, "steps": 24, "world_size": 1}
    fields.update(changes)
    return build_statement(make_artifact(tmp_path / f"art-{len(os.listdir(tmp_path))}"), inputs(**fields))


class _Tags(HTMLParser):
    """The start tags and the text of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parsed(page: str) -> _Tags:
    parser = _Tags()
    parser.feed(page)
    parser.close()
    return parser


def _markdown_as_html(markdown: str) -> str:
    """The Markdown as a renderer that lets raw HTML through makes it (GFM tables on)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown)


def test_the_datasheet_says_where_the_data_came_from_how_it_was_cleaned_trained_and_evaluated(tmp_path, web_text):
    report = _report_bytes(web_text)
    statement = _statement(tmp_path, web_text, report)
    sources = DatasheetSources(quarantine_report=report, contract_suite=web_text.suite, corpus_metadata=_corpus_json())
    sheet = build_datasheet(statement, sources)
    facts = {s.title: {f.label: (f.value, f.source) for f in s.facts} for s in sheet.sections}

    data = facts["Training data: where it came from"]
    assert data["corpus"] == ("webtext", "statement")
    assert data["snapshot (DVC id)"] == ("0123456789abcdef0123456789abcdef.dir", "statement")
    assert data["snapshot copy the run read"] == (SNAPSHOT, "statement")
    assert data["import source"] == ("files: 1; format: jsonl; input: imported.jsonl.gz; text_field: text", "corpus.json")
    assert data["corpus.json sha256"] == (hashlib.sha256(_corpus_json()).hexdigest(), "corpus.json")
    assert data["shards validated"] == ("4, of which 2 healthy", "quarantine report")
    assert data["documents trained on"] == ("75 (of 80 in the healthy shards)", "quarantine report")

    cleaning = facts["Training data: how it was cleaned"]
    assert cleaning["data contract"] == ("web-text@1", "statement")
    assert cleaning["data gate outcome"][0] == "pass: 2 of 4 shards quarantined (share 0.5)"
    assert cleaning["documents dropped"][0].startswith("5 of 80 in the healthy shards")
    assert cleaning["near-duplicates removed"] == (
        "3 documents from the healthy shards, 1 of them near copies of eval documents", "quarantine report")
    assert cleaning["eval decontamination"] == (
        "rule no_eval_contamination: 2 exact copies of eval documents found in 1 shards, quarantined; "
        "1 near copies dropped", "quarantine report")
    tables = {t.title.split(" (")[0]: t for s in sheet.sections for t in s.tables}
    assert tables["Quarantined shards"].rows == (
        ("train/shard-00002.parquet", "42",
         "no_eval_contamination (expect_column_values_to_be_in_set on kiln_text_in_eval_split): 2"),
        ("train/shard-00003.parquet", "40", "max_dropped_share (documents dropped: pii 30, c4_quality 2): 32"))
    dropped = {row[0]: row[1:] for row in tables["Documents dropped, by rule"].rows}
    assert dropped["pii"] == ("0", "30", "email 10, phone 10, public_ip 10")
    assert dropped["near_duplicate"] == ("3", "3", "eval_split 1, near_duplicate 2")
    shard_rules = {row[0] for row in tables["Shard rules"].rows}
    assert {"no_secrets", "no_eval_contamination", "unique_ids"} <= shard_rules
    assert {"pii", "c4_quality", "near_duplicate"} <= {row[0] for row in tables["Document rules"].rows}

    training = facts["How the model was trained"]
    assert training["steps trained"] == ("24", "statement")
    assert training["tokens trained on"] == (
        "12,288 (steps 24 x global batch 8 sequences x block size 64)", "derived")
    assert training["launcher"] == ("local", "statement") and training["nodes"] == ("node-a, node-b", "statement")
    assert training["trainer"][0] == f"kiln from kiln 0.1.0, source sha256 {'ab' * 32}"
    assert training["model"][0] == "block_size 64, n_embd 64, n_head 2, n_layer 2"
    evaluation = facts["How the model was evaluated"]
    assert evaluation["bits per byte"] == ("2.5", "statement")
    assert evaluation["model gate"] == ("promote: first model", "statement")
    assert "No approval is recorded" in next(s for s in sheet.sections if s.title == "Who approved it").notes[0]

    markdown, page = render(statement, sources)
    assert (markdown, page) == (datasheet_markdown(sheet), datasheet_html(sheet))
    for text in (markdown, " ".join(_parsed(page).text)):
        for fact in ("0123456789abcdef0123456789abcdef.dir", "imported.jsonl.gz", "no_eval_contamination",
                     "12,288", '"n_embd": 64'):
            assert fact in text.replace("\\_", "_"), fact
    assert render(statement, sources) == (markdown, page)  # the same statement and sources, the same bytes


def test_hostile_values_stay_text_in_both_renderings(tmp_path, web_text):
    report = _report_bytes(web_text)
    evil = "<script>alert(1)</script>"
    statement = _statement(tmp_path, web_text, report, corpus=evil,
                           recipe={**RECIPE, "trainer": {"note": "```\n</pre><img src=x onerror=alert(2)> | x"}})
    sources = DatasheetSources(quarantine_report=report, contract_suite=web_text.suite,
                               corpus_metadata=_corpus_json("<b>bold</b>"), model_version="m/1",
                               approval_tags={"kiln.review.comment": "<iframe src=//evil>", "kiln.review": "approved"})
    markdown, page = render(statement, sources)
    allowed = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "small", "p", "table", "tr", "th",
               "td", "code", "details", "summary", "pre", "ul", "li", "b"}
    parsed = _parsed(page)
    assert parsed.tags <= allowed, parsed.tags - allowed
    text = "".join(parsed.text)
    assert evil in text and "<iframe src=//evil>" in text and "<img src=x onerror=alert(2)>" in text
    assert "<b>bold</b>" in text  # the import source's name, as text: the only <b> tags are the legend's
    as_html = _markdown_as_html(markdown)
    rendered = _parsed(as_html)
    assert rendered.tags <= allowed | {"strong", "thead", "tbody"}, rendered.tags
    rendered_text = "".join(rendered.text)
    assert evil in rendered_text and "<iframe src=//evil>" in rendered_text and "<b>bold</b>" in rendered_text
    assert as_html.count("<pre>") == 1  # the recipe's backticks do not end its fenced block


def test_a_source_whose_digest_differs_from_the_signed_one_is_named_and_not_shown(tmp_path, web_text):
    report = _report_bytes(web_text)
    statement = _statement(tmp_path, web_text, report)
    edited = report.replace(b'"gate": "pass"', b'"gate": "fail"')
    suite = {**web_text.suite, "expectations": web_text.suite["expectations"][:-1]}  # no contamination rule
    sheet = build_datasheet(statement, DatasheetSources(quarantine_report=edited, contract_suite=suite))
    labels = {f.label for s in sheet.sections for f in s.facts}
    assert "data gate outcome" not in labels and "documents dropped" not in labels
    assert not [t for s in sheet.sections for t in s.tables]
    gaps = next(s for s in sheet.sections if s.title == "What this datasheet cannot say").notes
    assert gaps[0] == (f"The quarantine report at hand has sha256 {hashlib.sha256(edited).hexdigest()}, the statement "
                       f"signed {hashlib.sha256(report).hexdigest()}: it is not shown.")
    assert gaps[1].startswith("The installed contract web-text@1 has suite sha256 ") and "its rules are not listed" in gaps[1]

    missing = build_datasheet(statement, DatasheetSources())
    notes = [n for s in missing.sections for n in s.notes]
    assert any(n.startswith("The quarantine report the statement names was not at hand") for n in notes)
    assert any(n.startswith("The import source is not recorded") for n in notes)


def test_what_the_stages_did_not_record_is_said_not_guessed(tmp_path, web_text):
    statement = _statement(tmp_path, web_text, b"", quarantine_report_sha256="", contract_suite_sha256="", nodes=(),
                           started_on="", finished_on="", tokenizer_sha256="", token_manifest_sha256="",
                           token_manifest_uri="", max_quarantine_share=None)
    sheet = build_datasheet(statement, DatasheetSources(quarantine_report=b"{}", contract_suite=web_text.suite))
    facts = {f.label: f.value for s in sheet.sections for f in s.facts}
    assert facts["nodes"] == "not recorded" and facts["ran"] == "not recorded to not recorded"
    assert facts["contract suite sha256"] == "not recorded"
    assert facts["data gate threshold"] == "quarantined share at most not recorded"
    assert facts["token manifest sha256"] == "none (trained on the byte stream)"
    assert "data gate outcome" not in facts  # an unbound report is not read
    gaps = next(s for s in sheet.sections if s.title == "What this datasheet cannot say").notes
    assert gaps[0] == ("Not recorded by the stages before registration: contract_suite_sha256, quarantine_report, "
                       "tokenizer_sha256, nodes, startedOn, finishedOn.")


def test_the_approval_is_the_signed_one_else_the_version_tags_named_as_not_signed(tmp_path, web_text):
    report = _report_bytes(web_text)
    signed = _statement(tmp_path, web_text, report, approval={"approver": "alice", "at": "2026-01-02T00:00:00Z"})
    section = next(s for s in build_datasheet(signed).sections if s.title == "Who approved it")
    assert [(f.label, f.value, f.source) for f in section.facts] == [
        ("approver", "alice", "statement"), ("at", "2026-01-02T00:00:00Z", "statement")]

    tags = {"kiln.review": "approved", "kiln.review.by": "bob", "kiln.promotion.approver": "bob",
            "kiln.weights_sha256": "f" * 64, "kiln.reviewed": "x"}
    assert approval_tags(tags) == {"kiln.promotion.approver": "bob", "kiln.review": "approved", "kiln.review.by": "bob"}
    statement = _statement(tmp_path, web_text, report)
    section = next(s for s in build_datasheet(statement, DatasheetSources(approval_tags=approval_tags(tags))).sections
                   if s.title == "Who approved it")
    assert ("kiln.review.by", "bob", "version tags") in [(f.label, f.value, f.source) for f in section.facts]
    assert "kiln.weights_sha256" not in {f.label for f in section.facts}
    assert section.notes == ("These tags were written after registration and are not signed.",)


def test_a_statement_that_is_not_kiln_s_shape_gets_no_datasheet():
    with pytest.raises(ProvenanceError, match="not kiln's shape"):
        build_datasheet({"_type": "https://in-toto.io/Statement/v1", "subject": [], "predicate": {}})


def test_local_sources_read_what_the_statement_names_and_never_through_a_link(tmp_path, web_text):
    report = _report_bytes(web_text)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "quarantine-report.json").write_bytes(report)
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "corpus.json").write_bytes(_corpus_json())
    statement = _statement(tmp_path, web_text, report, quarantine_report_uri=str(tmp_path / "run" / "quarantine-report.json"),
                           snapshot_path=str(tmp_path / "snap"))
    sources = local_sources(statement, model_version="m/3", approval_tags={"kiln.review": "approved"})
    assert sources.quarantine_report == report and sources.corpus_metadata == _corpus_json()
    assert sources.contract_suite == web_text.suite  # the installed contract the statement names
    assert (sources.model_version, dict(sources.approval_tags)) == ("m/3", {"kiln.review": "approved"})

    (tmp_path / "snap" / "corpus.json").unlink()
    (tmp_path / "snap" / "corpus.json").symlink_to(tmp_path / "run" / "quarantine-report.json")
    assert local_sources(statement).corpus_metadata is None
    gone = local_sources(statement, quarantine_report=tmp_path / "nowhere.json")
    assert gone.quarantine_report is None

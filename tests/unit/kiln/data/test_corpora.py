"""``kiln.data.corpora``: a corpus' record, the registry of corpora under the corpus root, what the
sandbox form offers, and which contract a run validates with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.data.corpora import (
    CorpusMetadata,
    SplitStats,
    contract_refs,
    default_contract,
    form_choices,
    list_corpora,
    read_metadata,
    run_contract,
    write_metadata,
)
from kiln.errors import ConfigError, CorpusInputError


def _meta(kind: str = "natural-language", contract: str = "other-text@1") -> CorpusMetadata:
    stats = SplitStats(shards=2, documents=10, text_bytes=1000)
    return CorpusMetadata(kind=kind, contract=contract, producer="test", source={"format": "jsonl"}, split={"seed": 0},
                          train=stats, eval=SplitStats(shards=1, documents=1, text_bytes=100))


def test_the_record_round_trips_and_a_bad_one_is_named(tmp_path: Path) -> None:
    write_metadata(tmp_path, _meta())
    assert read_metadata(tmp_path) == _meta()
    assert read_metadata(tmp_path / "nothing-here") is None
    data = json.loads((tmp_path / "corpus.json").read_text())
    del data["contract"]
    (tmp_path / "corpus.json").write_text(json.dumps(data))
    with pytest.raises(CorpusInputError, match=r"corpus.json: field 'contract' is missing"):
        read_metadata(tmp_path)
    (tmp_path / "corpus.json").write_text(json.dumps({**data, "contract": "x@1", "kind": "poetry"}))
    with pytest.raises(CorpusInputError, match="kind must be one of python-source, natural-language, source-code, got 'poetry'"):
        read_metadata(tmp_path)
    (tmp_path / "corpus.json").write_text("{")
    with pytest.raises(CorpusInputError, match="corpus.json: not a JSON corpus record"):
        read_metadata(tmp_path)


def test_the_registry_lists_corpus_folders_and_says_what_is_wrong_with_one(tmp_path: Path) -> None:
    (tmp_path / "web").mkdir()
    write_metadata(tmp_path / "web", _meta())
    (tmp_path / "old").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "corpus.json").write_text("[]")
    (tmp_path / ".kiln-import-web.new-x").mkdir()  # an import being written
    (tmp_path / "Not A Name").mkdir()
    entries = {e.name: e for e in list_corpora(tmp_path)}
    assert list(entries) == ["broken", "old", "web"]
    assert entries["web"].metadata == _meta() and "natural-language, contract other-text@1" in entries["web"].label()
    assert entries["old"].metadata is None and "no corpus.json" in entries["old"].label()
    assert entries["broken"].problem and "unreadable" in entries["broken"].label()
    assert list_corpora(tmp_path / "missing") == []


def test_the_form_offers_every_corpus_and_each_contract_with_the_corpora_it_fits(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    write_metadata(tmp_path / "mine", _meta("python-source", "stdlib-py@1"))
    choices = form_choices("stdlib-py", tmp_path)
    assert choices.corpora == ["mine", "stdlib-py"] and "not built yet" in choices.corpus_labels["stdlib-py"]
    assert choices.contracts == [None, *contract_refs()] and "stdlib-py@1" in choices.contracts
    assert choices.contract_labels["stdlib-py@1"] == "stdlib-py@1 — fits mine"


def test_a_runs_contract_is_its_own_choice_else_the_corpus_else_the_policys() -> None:
    web = _meta()
    assert run_contract(None, web, "stdlib-py@1", corpus="web") == "other-text@1"
    assert run_contract("", None, "stdlib-py@1", corpus="old") == "stdlib-py@1"
    assert run_contract("other-text@2", web, "stdlib-py@1", corpus="web") == "other-text@2"
    with pytest.raises(ConfigError, match="contract 'stdlib-py@1' does not fit corpus 'web': .*natural-language"):
        run_contract("stdlib-py@1", web, "stdlib-py@1", corpus="web")
    # A pinned policy validates with its own contract only, and only a corpus made for it.
    assert run_contract(None, _meta("python-source", "stdlib-py@1"), "stdlib-py@1", corpus="p", pinned=True) == "stdlib-py@1"
    with pytest.raises(ConfigError, match="validates only with 'stdlib-py@1'"):
        run_contract("other-text@1", None, "stdlib-py@1", corpus="p", pinned=True)
    with pytest.raises(ConfigError, match="does not fit corpus 'web'"):
        run_contract(None, web, "stdlib-py@1", corpus="web", pinned=True)


def test_the_default_contract_of_a_kind_is_the_latest_shipped_one() -> None:
    assert default_contract("python-source") == "stdlib-py@1"
    with pytest.raises(ConfigError, match="kind must be one of"):
        default_contract("poetry")


@pytest.mark.parametrize("hostile", ["deep", "digits", "dev-zero", "fifo", "outside-link", "directory"])
def test_a_hostile_corpus_record_is_listed_as_unreadable_and_the_form_still_builds(tmp_path: Path, hostile: str) -> None:
    import os

    (tmp_path / "web").mkdir()
    write_metadata(tmp_path / "web", _meta())
    bad = tmp_path / "bad"
    bad.mkdir()
    record = bad / "corpus.json"
    outside = tmp_path.parent / f"{tmp_path.name}-outside.json"
    outside.write_text((tmp_path / "web" / "corpus.json").read_text())
    make = {"deep": lambda: record.write_text('{"format": ' + "[" * 200_000),
            "digits": lambda: record.write_text('{"format": ' + "9" * 5000 + "}"),
            "dev-zero": lambda: record.symlink_to("/dev/zero"),
            "fifo": lambda: os.mkfifo(record),
            "outside-link": lambda: record.symlink_to(outside),
            "directory": lambda: record.mkdir()}
    make[hostile]()
    entries = {e.name: e for e in list_corpora(tmp_path)}
    assert entries["web"].metadata == _meta() and entries["web"].problem is None
    assert entries["bad"].metadata is None and entries["bad"].problem.startswith(f"{record}: not a JSON corpus record: ")
    choices = form_choices("web", tmp_path)
    assert choices.corpus_labels["bad"] == "bad (unreadable corpus.json)"


def test_a_contract_made_for_the_corpus_kind_of_text_fits_it_and_one_of_another_kind_is_still_refused() -> None:
    """Hard-wrapped prose and web text are both natural language; the stdlib sample is Python source,
    which the general source-code contract fits too; nothing crosses from code to prose or back."""
    web, stdlib = _meta("natural-language", "web-text@1"), _meta("python-source", "stdlib-py@1")
    assert run_contract("prose-wrapped@1", web, "stdlib-py@1", corpus="docs") == "prose-wrapped@1"
    assert run_contract("source-code@1", stdlib, "stdlib-py@1", corpus="stdlib-py") == "source-code@1"
    assert run_contract(None, _meta("source-code", "source-code@1"), "stdlib-py@1", corpus="repo") == "source-code@1"
    for requested, meta, corpus in (("source-code@1", web, "docs"), ("prose-wrapped@1", stdlib, "stdlib-py"),
                                    ("stdlib-py@1", _meta("source-code", "source-code@1"), "repo")):
        with pytest.raises(ConfigError, match=f"contract '{requested}' does not fit corpus '{corpus}': .*families that fit"):
            run_contract(requested, meta, "stdlib-py@1", corpus=corpus)
    assert default_contract("source-code") == "source-code@1"
    labels = form_choices("stdlib-py").contract_labels
    assert set(labels) >= {"prose-wrapped@1", "source-code@1"}

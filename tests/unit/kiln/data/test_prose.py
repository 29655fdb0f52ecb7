"""``kiln.data.prose``: the natural-language sample from text found on the machine, cut at
paragraphs, deterministic, and a valid input of ``kiln corpus import``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kiln.data.corpus import MAX_DOC_BYTES, MIN_DOC_CHARS
from kiln.data.prose import LICENSES_DIR, build_prose, chunk_text, extract_prose, man_pages, roff_to_text
from kiln.errors import ConfigError


def test_chunks_keep_every_character_and_stay_under_the_limit() -> None:
    paragraph = "A sentence of plain prose, repeated to make a paragraph. " * 20 + "\n\n"
    long_line = "é" * (MAX_DOC_BYTES)  # one line longer than a document: cut at a character boundary
    text = paragraph * 9 + long_line + "\n\nlast words\n"
    chunks = chunk_text(text)
    assert "".join(chunks) == text
    assert all(len(c.encode("utf-8")) <= MAX_DOC_BYTES for c in chunks)
    assert all(c.endswith("\n\n") for c in chunks[:3]), "cut between paragraphs"


def test_the_prose_of_a_hard_wrapped_text_is_unwrapped_and_its_code_left_out() -> None:
    text = ('The "assert" statement\n**********************\n\n'
            "Assert statements are a convenient way\nto insert debugging assertions.\n\n"
            '   assert_stmt ::= "assert" expression\n\n'
            "The simple form is equivalent to\n\n   if __debug__:\n       raise AssertionError\n\n"
            "  A paragraph indented by two,\nas the GPL's are.\n\n"
            "* A list item\n  wrapped under its text.\n\n\tTabbed listing\n\n\n")
    assert extract_prose(text) == ('The "assert" statement\n\n'
                                   "Assert statements are a convenient way to insert debugging assertions.\n\n"
                                   "The simple form is equivalent to\n\n"
                                   "A paragraph indented by two, as the GPL's are.\n\n"
                                   "* A list item wrapped under its text.\n")
    assert extract_prose("   only code\n\n====\n") == ""


def test_roff_becomes_the_words_of_the_page() -> None:
    roff = r""".\" a comment
.TH DEMO 1 "May 2026"
.de XX
.ft B
..
.SH NAME
demo \- show \fBbold\fR and \fIitalic\fP words
.SH DESCRIPTION
.PP
The \(lqdemo\(rq program prints \-\-help and exits\(em quickly.
.TP
.BR \-v ", " \-\-verbose
say more \e and \[bu] more
"""
    text = roff_to_text(roff)
    assert text == ("NAME\n\ndemo - show bold and italic words\n\nDESCRIPTION\n\n"
                    "The “demo” program prints --help and exits— quickly.\n\n-v, --verbose\nsay more \\ and • more\n")


def test_the_sample_is_deterministic_and_comes_from_pydoc_and_the_licences(tmp_path: Path) -> None:
    first = build_prose(tmp_path / "a.jsonl")
    build_prose(tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    docs = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert first["documents"] == len(docs) and first["by_source"]["pydoc"] > 100
    if LICENSES_DIR.is_dir():  # every Debian machine (base-files)
        assert first["by_source"]["licenses"] > 20
        # GPL-3's preamble, hard-wrapped at "for" in the file: one line here.
        assert any("is a free, copyleft license for software and other kinds of works." in d["text"] for d in docs)
    assert len({d["id"] for d in docs}) == len(docs) and len({d["text"] for d in docs}) == len(docs)
    assert all(len(d["text"].strip()) >= MIN_DOC_CHARS and len(d["text"].encode()) <= MAX_DOC_BYTES for d in docs)
    assert docs[0]["id"].startswith("pydoc/") and docs[0]["source"] == docs[0]["id"].split("#")[0]


def test_man_pages_are_read_from_their_section_folders(tmp_path: Path) -> None:
    (tmp_path / "man1").mkdir()
    page = ".TH T 1\n.SH NAME\nt \\- a test page with enough words to be a document of its own\n"
    (tmp_path / "man1" / "t.1.gz").write_bytes(gzip.compress(page.encode()))
    (tmp_path / "man1" / "alias.1.gz").write_bytes(gzip.compress(b".so man1/t.1\n"))
    (tmp_path / "man1" / "broken.1.gz").write_bytes(b"not gzip")
    assert [s for s, _ in man_pages(["1", "5"], tmp_path)] == ["man/man1/t.1"]
    with pytest.raises(ConfigError, match="man sections"):
        build_prose(tmp_path / "x.jsonl", ["12"])


def test_the_sample_imports_as_a_natural_language_corpus(tmp_path: Path) -> None:
    from kiln.data.corpora import read_metadata
    from kiln.data.corpus_import import ImportConfig, import_corpus

    build_prose(tmp_path / "prose.jsonl")
    # web-text (the contract made for natural language) is another engineer's; stdlib-py checks the layout.
    summary = import_corpus(tmp_path / "prose.jsonl", tmp_path / "corpora" / "prose",
                            ImportConfig(name="prose", format="jsonl", id_field="id", eval_fraction=0.1,
                                         kind="natural-language", contract="stdlib-py@1"))
    meta = read_metadata(tmp_path / "corpora" / "prose")
    assert meta is not None and meta.kind == "natural-language" and meta.eval.documents > 5
    assert summary["train"]["documents"] + summary["eval"]["documents"] == sum(
        1 for _ in (tmp_path / "prose.jsonl").open())

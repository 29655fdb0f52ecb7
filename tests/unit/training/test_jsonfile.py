"""The one JSON reader: hostile structure becomes the caller's error naming the file, never a traceback
or an unbounded read."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kiln_trainer.jsonfile import MAX_DEPTH, MAX_NUMBER_DIGITS, load_json, parse_json, read_bounded, read_json


class Refused(ValueError):
    pass


def test_reads_an_ordinary_document(tmp_path: Path) -> None:
    doc = {"a": [1, -2.5e3, True, None, 'x [ { " \\'], "b": {"c": [[[]]]}, "ü": "\u2603"}
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc, ensure_ascii=False))
    raw, parsed = read_json(path, "record", Refused)
    assert parsed == doc and raw == path.read_bytes()
    assert load_json(path, "record", Refused) == doc


def test_depth_is_bounded_without_recursion() -> None:
    assert parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, "f.json", Refused) is not None
    for deep in ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), '{"a":' * 100_000, "[" * 1_000_000):
        with pytest.raises(Refused, match=rf"^f\.json: nested deeper than {MAX_DEPTH} levels"):
            parse_json(deep, "f.json", Refused)


def test_brackets_and_digits_inside_strings_do_not_count() -> None:
    text = json.dumps({"s": "[" * 1000 + "{" * 10 + "9" * 5000, "e": 'a\\"[[[[' * 100})
    assert parse_json(text, "f.json", Refused)["s"].startswith("[[[")


def test_long_numbers_are_refused() -> None:
    assert parse_json("1" * MAX_NUMBER_DIGITS, "f.json", Refused) == int("1" * MAX_NUMBER_DIGITS)
    for number in ("9" * 5000, "1" * (MAX_NUMBER_DIGITS + 1), "0." + "1" * 200, "[1e" + "9" * 200 + "]"):
        with pytest.raises(Refused, match=rf"f\.json: a number has more than {MAX_NUMBER_DIGITS} digits"):
            parse_json(number, "f.json", Refused)


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", '{"a": -Infinity}'])
def test_non_json_constants_are_refused(text: str) -> None:
    with pytest.raises(Refused, match="f.json: not JSON: .* is not a JSON number"):
        parse_json(text, "f.json", Refused)


@pytest.mark.parametrize(("raw", "fault"), [(b"", "not JSON: Expecting value at line 1 column 1"),
                                           (b'{"a": 1,\n"b"}', "not JSON: Expecting ':' delimiter at line 2 column 4"),
                                           (b'"\xff"', "not JSON: not UTF-8 \\(byte 1\\)"),
                                           (b'{"a": 1} x', "not JSON: Extra data")])
def test_malformed_documents_name_where_and_what(raw: bytes, fault: str) -> None:
    with pytest.raises(Refused, match=f"^f.json: {fault}"):
        parse_json(raw, "f.json", Refused)


def test_a_hook_error_becomes_the_callers_error() -> None:
    def no_twice(pairs: list[tuple[str, object]]) -> dict[str, object]:
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("a key is given twice")
        return dict(pairs)

    with pytest.raises(Refused, match="f.json: not JSON: a key is given twice"):
        parse_json('{"a": 1, "a": 2}', "f.json", Refused, object_pairs_hook=no_twice)


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    for path, fault in ((fifo, "not a regular file"), (Path("/dev/zero"), "not a regular file"),
                        (tmp_path, "cannot read record"), (tmp_path / "missing.json", "No such file")):
        with pytest.raises(Refused, match=f"^{path}: .*{fault}"):
            read_json(path, "record", Refused)
    assert time.monotonic() - start < 5  # opening a FIFO with no writer did not block


def test_size_is_bounded_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps(list(range(100))))
    assert len(read_bounded(path, "record", Refused, max_bytes=10_000)) == path.stat().st_size
    with pytest.raises(Refused, match=rf"^{path}: record is \d+ bytes, over the 100-byte limit"):
        read_json(path, "record", Refused, max_bytes=100)


def test_a_symlink_to_a_device_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "corpus.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(Refused, match="not a regular file"):
        load_json(link, "corpus record", Refused)


def test_a_large_ordinary_document_is_read_in_linear_time() -> None:
    doc = {"rows": list(range(2_000_000)), "names": ["x" * 10] * 200_000}
    text = json.dumps(doc)
    start = time.monotonic()
    assert parse_json(text, "f.json", Refused) == doc
    assert time.monotonic() - start < 30  # a bound, not a benchmark: about a second here


def test_a_link_is_refused_where_links_are_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "outside.json"
    target.write_text("{}")
    link = tmp_path / "inside.json"
    link.symlink_to(target)
    assert load_json(link, "record", Refused) == {}
    with pytest.raises(Refused, match=f"^{link}: cannot read record: is a symlink; kiln reads no file through a link here"):
        load_json(link, "record", Refused, follow_link=False)

"""Generated input content for ``kiln corpus import`` (issue 28, deliverable 5): JSON lines, Parquet
files and text trees that Hypothesis builds from hostile structure, encodings, links, devices and
sizes, each imported through ``kiln.cli.main``.

JSON lines: nesting past the reader's depth, numbers of thousands of digits, NaN and Infinity,
duplicate keys, every wrong type for the text and id fields, top-level values that are not objects,
invalid UTF-8, lone surrogates (escaped and raw), a BOM, CRLF, empty and blank lines, a cut-off
line; plain, gzip and zstd, truncated streams, concatenated members, a name that lies about the
compression, and a one-line bomb (65 MiB of text in 64 KiB) past the line cap. Parquet: the text
column as string, large_string, binary (valid or not UTF-8), dictionary, int, list or null type,
two ``text`` columns, ids of the wrong type, 0 rows, nulls, and files cut short, with a garbled
footer, empty or not Parquet at all. Text trees: links to a file and a folder beside the tree, to
``/proc/self/environ`` (which holds ``SECRET``), ``/dev/zero`` and ``/dev/null``, to themselves and
nowhere, FIFOs, names that are not UTF-8, hidden files, folders 40 deep, contents that are not UTF-8.

Every input must give what ``generated_inputs`` lists: exit 0 or 2 (bad input is a usage error),
one error line, no traceback, no file outside ``--root`` written, nothing from outside the input
imported, within the per-input time and memory bound. Derandomized; docs/reliability.md ("Generated
bad input") records the larger random runs and what they found.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from generated_inputs import EXAMPLES, SECRET, SETTINGS, Case, Entry, check, materialize, wipe
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

IMPORT = ("corpus", "import")


@pytest.fixture()
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """``(sandbox, outside)``: the working directory (``KILN_HOME`` inside it) and a folder beside it
    holding ``SECRET``, which generated links point at."""
    root, outside = tmp_path / "sandbox", tmp_path / "outside"
    root.mkdir()
    (outside / "folder").mkdir(parents=True)
    (outside / "secret.txt").write_text(f"PASSWORD={SECRET}\n")
    (outside / "secret.jsonl").write_text(json.dumps({"id": "s", "text": f"PASSWORD={SECRET}"}) + "\n")
    (outside / "folder" / "note.txt").write_text(f"a note beside the tree: {SECRET}\n")
    monkeypatch.chdir(root)
    monkeypatch.setenv("KILN_HOME", str(root / "home"))
    monkeypatch.setenv("KILN_GENERATED_SECRET", SECRET)
    yield root, outside


def run_cases(strategy: st.SearchStrategy[Case], sandbox: tuple[Path, Path], name: str,
              explicit: tuple[Case, ...] = ()) -> Counter:
    root, outside = sandbox
    outcomes: Counter = Counter()

    def one(case: Case) -> None:
        try:
            materialize(root, case.entries)
            check(root, outside, case, outcomes)
        finally:
            wipe(root)

    for case in explicit:
        one(case)

    @SETTINGS
    @given(strategy)
    def generated(case: Case) -> None:
        one(case)

    generated()
    print(f"{name}: {sum(outcomes.values())} inputs, exit statuses {dict(sorted(outcomes.items()))}")
    assert sum(outcomes.values()) >= min(EXAMPLES, 10)
    return outcomes


BASE_DOCUMENTS = 24
"""Good documents every generated input starts with, so that a clean example has a held-out split."""


def base_texts() -> list[str]:
    return [f"Base document {i} of the generated import, plain prose with nothing odd in it." for i in range(BASE_DOCUMENTS)]


def import_argv(src: str, fmt: str, *, id_field: bool, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    argv = (*IMPORT, src, "--name", "mine", "--format", fmt, "--root", "out", "--eval-fraction", "0.3",
            "--kind", "natural-language", *extra)
    return (*argv, "--id-field", "id") if id_field else argv


# -- JSON lines ------------------------------------------------------------------------------------------

DEEP = [10, 64, 65, 1000, 100_000]
HOSTILE_VALUES = st.one_of(
    st.sampled_from(DEEP).map(lambda n: "[" * n + "]" * n),
    st.sampled_from(DEEP).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.sampled_from([20, 101, 4301, 5000, 100_000]).map(lambda n: "9" * n),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0", "0.1e-400", "null", "true", "false", "{}", "[]",
                     '"\\ud800"', '"\\udfff\\ud800"', '"a\\u0000b"', '"\\ud83d\\ude00"', '""', '"\\uZZZZ"', "'single'",
                     '"unterminated', "1 2"]),
    st.text(max_size=30).map(json.dumps),
)
GOOD_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=80).map(
    lambda t: json.dumps("Some prose of the generated import. " + t))


@st.composite
def json_lines(draw) -> bytes:
    """One line (without its end), most of the time a good record."""
    kind = draw(st.sampled_from(["good"] * 4 + ["hostile_text", "hostile_id", "duplicate", "not_object", "raw", "cut",
                                                "empty"]))
    ident = json.dumps(f"d{draw(st.integers(0, 40))}")
    if kind == "good":
        return f'{{"id": {ident}, "text": {draw(GOOD_TEXT)}}}'.encode()
    if kind == "hostile_text":
        return f'{{"id": {ident}, "text": {draw(HOSTILE_VALUES)}}}'.encode()
    if kind == "hostile_id":
        return f'{{"id": {draw(HOSTILE_VALUES)}, "text": {draw(GOOD_TEXT)}}}'.encode()
    if kind == "duplicate":
        return f'{{"id": {ident}, "text": {draw(GOOD_TEXT)}, "text": {draw(HOSTILE_VALUES)}}}'.encode()
    if kind == "not_object":
        return draw(HOSTILE_VALUES).encode()
    if kind == "raw":  # bytes that are no UTF-8, a raw surrogate, NUL, a lone continuation byte, a BOM mid-file
        junk = draw(st.sampled_from([b"\xff\xfe", b"\xed\xa0\x80", b"\x00", b"\x80", b"\xef\xbb\xbf", b"\xc3"]))
        return b'{"id": ' + ident.encode() + b', "text": "bad ' + junk + b' bytes"}'
    if kind == "cut":
        return f'{{"id": {ident}, "text": {draw(GOOD_TEXT)}'.encode()[: draw(st.integers(1, 40))]
    return draw(st.sampled_from([b"", b"   ", b"\t"]))


@functools.cache
def one_line_bomb() -> bytes:
    """65 MiB of one JSON line in about 64 KiB of gzip: past the 64 MiB line cap."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(b'{"id": "bomb", "text": "')
        block = b"a" * (1 << 20)
        for _ in range(65):
            f.write(block)
        f.write(b'"}\n')
    return buffer.getvalue()


@st.composite
def jsonl_files(draw) -> tuple[str, bytes]:
    """A file name and its bytes: lines joined by LF or CRLF, maybe a BOM, maybe compressed, maybe cut."""
    clean = st.one_of(GOOD_TEXT.map(lambda t: f'{{"id": "d{len(t)}", "text": {t}}}'.encode()), st.just(b""))
    lines = draw(st.lists(json_lines() if draw(st.booleans()) else clean, min_size=0, max_size=12))
    end = draw(st.sampled_from([b"\n", b"\n", b"\r\n"]))
    data = end.join(lines) + (end if draw(st.booleans()) else b"")
    if draw(st.integers(0, 7)) == 0:
        data = b"\xef\xbb\xbf" + data
    wrap = draw(st.sampled_from(["plain"] * 8 + ["gzip", "gzip", "zstd", "zstd", "gzip_cut", "zstd_cut", "gzip_twice",
                                                 "lying_name", "bomb"]))
    suffix = draw(st.sampled_from([".jsonl", ".ndjson", ".json"]))
    if wrap == "plain":
        return f"docs{suffix}", data
    if wrap == "lying_name":  # plain text under a compressed name, and garbage under one
        return f"docs{suffix}.gz", draw(st.sampled_from([data, b"\x1f\x8b\x08garbage", b"\x28\xb5\x2f\xfdgarbage"]))
    if wrap == "bomb":
        return "docs.jsonl.gz", one_line_bomb()
    if wrap.startswith("gzip"):
        packed = gzip.compress(data, mtime=0)
        if wrap == "gzip_twice":
            packed += gzip.compress(data, mtime=0)
        name = f"docs{suffix}.gz"
    else:
        packed = pa.Codec("zstd").compress(data, asbytes=True)
        name = f"docs{suffix}.zst"
    if wrap.endswith("_cut"):
        packed = packed[: draw(st.integers(0, max(0, len(packed) - 1)))]
    return name, packed


@st.composite
def jsonl_cases(draw) -> Case:
    files = draw(st.lists(jsonl_files(), min_size=1, max_size=3))
    id_field = draw(st.booleans())
    base = "".join(json.dumps({"id": f"base{i}", "text": t}) + "\n" for i, t in enumerate(base_texts())).encode()
    if len(files) == 1 and draw(st.booleans()):
        name, data = files[0]
        if not name.endswith((".gz", ".zst")):
            data = base + data
        return Case((Entry("file", f"in/{name}".encode(), data),), import_argv(f"in/{name}", "jsonl", id_field=id_field),
                    outputs=("out",), note="one JSON lines file")
    entries = [Entry("file", b"in/base.jsonl", base)]
    entries += [Entry("file", f"in/{i}-{name}".encode(), data) for i, (name, data) in enumerate(files)]
    if draw(st.booleans()):  # a link in the tree to JSON lines beside it: skipped, never read
        entries.append(Entry("link", b"in/linked.jsonl", b"../../outside/secret.jsonl"))
    return Case(tuple(entries), import_argv("in", "jsonl", id_field=id_field), outputs=("out",), note="a folder of JSON lines")


def test_generated_json_lines_import_or_fail_in_one_line(sandbox: tuple[Path, Path]) -> None:
    bomb = Case((Entry("file", b"in/docs.jsonl.gz", one_line_bomb()),), import_argv("in/docs.jsonl.gz", "jsonl", id_field=False),
                outputs=("out",), note="one-line gzip bomb", must_say="docs.jsonl.gz:1: the line is longer than")
    outcomes = run_cases(jsonl_cases(), sandbox, "jsonl", explicit=(bomb,))
    assert outcomes[2] and outcomes[0]  # the examples reach both sides of the line


# -- Parquet ---------------------------------------------------------------------------------------------

PROSE = st.text(max_size=40).map(lambda t: "generated parquet prose " + t)
TEXTS = st.one_of(st.lists(PROSE, max_size=12), st.lists(st.one_of(st.none(), PROSE), max_size=12))


@st.composite
def parquet_tables(draw) -> pa.Table:
    texts = draw(TEXTS)
    n = len(texts)
    kind = draw(st.sampled_from(["string"] * 4 + ["large_string"] * 2 + [ "binary", "bad_binary", "dictionary", "int", "list",
                                 "null"]))
    if kind in ("string", "large_string"):
        text = pa.array(texts, type=getattr(pa, kind)())
    elif kind == "binary":
        text = pa.array([None if t is None else t.encode() for t in texts], type=pa.binary())
    elif kind == "bad_binary":
        text = pa.array([None if t is None else t.encode() + b"\xff\xed\xa0\x80" for t in texts], type=pa.binary())
    elif kind == "dictionary":
        text = pa.array(texts, type=pa.string()).dictionary_encode()
    elif kind == "int":
        text = pa.array(range(n), type=pa.int64())
    elif kind == "list":
        text = pa.array([[t] for t in texts], type=pa.list_(pa.string()))
    else:
        text = pa.nulls(n)
    columns, names = [text], [draw(st.sampled_from(["text"] * 12 + ["Text", "body", ""]))]
    ids = draw(st.sampled_from(["strings"] * 4 + ["none"] * 2 + ["ints", "duplicates", "nulls", "none"]))
    if ids != "none":
        values = {"strings": [f"r{i}" for i in range(n)], "ints": list(range(n)), "duplicates": ["same"] * n,
                  "nulls": [None] * n}[ids]
        columns.append(pa.array(values))
        names.append("id")
    if draw(st.integers(0, 9)) == 0:  # a second column of the same name
        columns.append(pa.array([f"other {i}" for i in range(n)], type=pa.string()))
        names.append(names[0])
    return pa.Table.from_arrays(columns, names=names)


@st.composite
def parquet_files(draw) -> bytes:
    table = draw(parquet_tables())
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=draw(st.integers(1, 5)), compression=draw(st.sampled_from(["zstd", "none"])))
    data = sink.getvalue()
    damage = draw(st.sampled_from(["none"] * 12 + ["cut", "footer", "empty", "not_parquet", "magic_only"]))
    if damage == "cut":
        return data[: draw(st.integers(0, len(data) - 1))]
    if damage == "footer":  # garble the footer's metadata, keep its length and magic
        at = draw(st.integers(max(4, len(data) - 60), len(data) - 9))
        return data[:at] + bytes(b ^ 0x5A for b in data[at:at + 4]) + data[at + 4:]
    if damage == "magic_only":
        return b"PAR1" + b"\x00" * draw(st.integers(0, 16)) + b"PAR1"
    return {"none": data, "empty": b"", "not_parquet": b"text,id\nhello,1\n"}[damage]


@st.composite
def parquet_cases(draw) -> Case:
    files = draw(st.lists(parquet_files(), min_size=1, max_size=3))
    base = io.BytesIO()
    texts = base_texts()
    pq.write_table(pa.table({"text": texts, "id": [f"base{i}" for i in range(len(texts))]}), base)
    entries = (Entry("file", b"in/base.parquet", base.getvalue()),
               *(Entry("file", f"in/part-{i}.parquet".encode(), data) for i, data in enumerate(files)))
    id_field = draw(st.booleans())
    if len(files) == 1 and not draw(st.integers(0, 3)):  # alone: 0 rows, or 1 row and no held-out split
        return Case(entries, import_argv("in/part-0.parquet", "parquet", id_field=id_field), outputs=("out",),
                    note="one Parquet file")
    return Case(entries, import_argv("in", "parquet", id_field=id_field), outputs=("out",), note="a folder of Parquet")


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_generated_parquet_files_import_or_fail_in_one_line(sandbox: tuple[Path, Path]) -> None:
    texts = base_texts()
    ordinary = (  # corpora as people have them: large_string beside string, an empty shard, binary that is UTF-8
        _parquet(pa.table({"text": pa.array(texts, type=pa.large_string())})),
        _parquet(pa.table({"text": pa.array([], type=pa.string())})),
        _parquet(pa.table({"text": pa.array([t.encode() for t in texts], type=pa.binary())})),
    )
    explicit = tuple(Case((Entry("file", b"in/a.parquet", _parquet(pa.table({"text": texts}))),
                           Entry("file", b"in/b.parquet", data)), import_argv("in", "parquet", id_field=False),
                          outputs=("out",), statuses=frozenset({0}), note="an ordinary corpus") for data in ordinary)
    outcomes = run_cases(parquet_cases(), sandbox, "parquet", explicit=explicit)
    assert outcomes[2] and outcomes[0]


# -- text trees ------------------------------------------------------------------------------------------

LINK_TARGETS = [b"../../outside/secret.txt", b"/proc/self/environ", b"/dev/zero", b"/dev/null", b"../../outside/folder",
                b"loop", b"nowhere", b"doc-0.txt", b"."]
FILE_NAMES = st.one_of(
    st.sampled_from([b"doc.txt", b".hidden", b"\xff\xfename.txt", b"caf\xe9.txt", b"new\nline.txt", b"x" * 255,
                     b"sub/inner.txt", b"-", b"--help"]),
    st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=20)
    .filter(lambda n: n not in (".", "..")).map(os.fsencode),
)
CONTENTS = st.one_of(
    st.text(min_size=1, max_size=60).map(lambda t: ("generated prose " + t).encode("utf-8", "surrogatepass")),
    st.sampled_from([b"", b"\xef\xbb\xbfa BOM first", b"\xff\xfe\x00n\x00o", b"line\r\nline\r\n", b"nul\x00inside",
                     b"\xed\xa0\x80 raw surrogate", b"\x80"]),
)


@st.composite
def text_entries(draw, i: int) -> list[Entry]:
    kind = draw(st.sampled_from(["file"] * 5 + ["link", "link", "fifo", "deep"]))
    name = draw(FILE_NAMES)
    if kind == "file":
        return [Entry("file", b"in/" + name, draw(CONTENTS))]
    if kind == "link":
        target = draw(st.sampled_from(LINK_TARGETS))
        link = b"in/" + (b"loop" if target == b"loop" else b"link-%d" % i)
        return [Entry("link", link, target)]
    if kind == "fifo":
        return [Entry("fifo", b"in/fifo-%d" % i)]
    depth = draw(st.sampled_from([2, 10, 40]))
    return [Entry("file", b"in/" + b"d/" * depth + name, draw(CONTENTS))]


@st.composite
def text_cases(draw) -> Case:
    count = draw(st.integers(1, 8))
    entries = [Entry("file", b"in/doc-0.txt", b"the first document of the generated tree\n")]
    entries += [Entry("file", b"in/base/%d.txt" % i, t.encode()) for i, t in enumerate(base_texts())]
    for i in range(count):
        entries += draw(text_entries(i))
    return Case(tuple(entries), import_argv("in", "text", id_field=False), outputs=("out",), note="a text tree")


def test_generated_text_trees_import_or_fail_in_one_line(sandbox: tuple[Path, Path]) -> None:
    every_link = Case((Entry("file", b"in/doc-0.txt", b"the first document\n"),
                       *(Entry("file", b"in/base/%d.txt" % i, t.encode()) for i, t in enumerate(base_texts())),
                       *(Entry("link", b"in/link-%d" % i, t) for i, t in enumerate(LINK_TARGETS) if t != b"loop"),
                       Entry("link", b"in/loop", b"loop")), import_argv("in", "text", id_field=False), outputs=("out",),
                      note="every kind of link at once")
    outcomes = run_cases(text_cases(), sandbox, "text", explicit=(every_link,))
    assert outcomes[2] and outcomes[0]


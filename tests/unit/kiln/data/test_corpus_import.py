"""``kiln corpus import``: kiln's layout from JSON lines, Parquet and text trees; byte-identical
re-imports; a held-out split by a keyed hash of the text; bounded memory; every bad input named by
file and line or row, with nothing left behind."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data.corpora import read_metadata
from kiln.data.corpus_import import (
    MAX_SHARD_ROWS,
    ImportConfig,
    import_corpus,
    parse_byte_size,
)
from kiln.errors import ConfigError, CorpusInputError

# web-text@1 is another engineer's contract; these tests name the one every kiln ships.
KIND = {"kind": "python-source"}


def _docs(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"id": f"d{i}", "text": f"Document {i}: " + "the quick brown fox jumps. " * (1 + i % 7), "lang": "en"}
            for i in range(start, start + n)]


def _jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _rows(root: Path, split: str = "train") -> list[dict[str, Any]]:
    return [r for p in sorted((root / split).glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def _left_behind(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


# ------------------------------------------------------------------------------------ good input


def test_jsonl_becomes_kilns_layout_with_stable_ids_and_a_record(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in" / "part.jsonl", _docs(300))
    out = tmp_path / "corpora" / "mine"
    summary = import_corpus(src, out, ImportConfig(name="mine", format="jsonl", eval_fraction=0.1, **KIND))
    train, held_out = _rows(out), _rows(out, "eval")
    assert len(train) + len(held_out) == 300 and held_out and train
    assert [f.name for f in pq.read_schema(out / "train" / "shard-00000.parquet")] == ["doc_id", "text", "source"]
    by_id = {r["doc_id"]: r for r in train + held_out}
    assert by_id["part.jsonl:1"]["text"] == _docs(1)[0]["text"]  # no --id-field: FILE:LINE
    assert by_id["part.jsonl:300"]["source"] == "part.jsonl"
    meta = read_metadata(out)
    assert meta is not None and (meta.kind, meta.contract) == ("python-source", "stdlib-py@1")
    assert meta.train.documents == len(train) and meta.eval.documents == len(held_out)
    assert meta.source["format"] == "jsonl" and meta.source["input"] == "part.jsonl"
    assert str(tmp_path) not in (out / "corpus.json").read_text(), "the record holds no absolute path"
    assert summary["train"]["documents"] == len(train)


def test_the_same_input_gives_byte_identical_files_plain_gzip_or_zstd(tmp_path: Path) -> None:
    records = _docs(400)
    plain = _jsonl(tmp_path / "plain" / "data.jsonl", records)
    # Compression is told by the magic bytes, so the files keep one name (the rows' `source`).
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "data.jsonl").write_bytes(gzip.compress(plain.read_bytes()))
    (tmp_path / "zst").mkdir()
    zst = pa.Codec("zstd").compress(plain.read_bytes(), asbytes=True)
    assert zst[:4] == b"\x28\xb5\x2f\xfd"
    (tmp_path / "zst" / "data.jsonl").write_bytes(zst)
    config = ImportConfig(name="same", format="jsonl", id_field="id", shard_bytes=4096, eval_fraction=0.2, **KIND)
    outs = {}
    for kind in ("plain", "gz", "zst"):
        import_corpus(tmp_path / kind / "data.jsonl", tmp_path / f"out-{kind}", config)
        outs[kind] = _files(tmp_path / f"out-{kind}")
    assert len([k for k in outs["plain"] if k.startswith("train/")]) > 3
    assert outs["plain"] == outs["gz"] == outs["zst"]
    # Imported again over itself: the same bytes.
    import_corpus(plain, tmp_path / "out-plain", config, replace=True)
    assert _files(tmp_path / "out-plain") == outs["plain"]


def test_a_directory_of_compressed_parts_is_read_in_path_order(tmp_path: Path) -> None:
    src = tmp_path / "dump"
    _jsonl(src / "b" / "part-2.jsonl", _docs(10, 10))
    (src / "a").mkdir()
    (src / "a" / "part-1.jsonl.gz").write_bytes(gzip.compress(b"".join(json.dumps(d).encode() + b"\n" for d in _docs(10))))
    (src / "README.md").write_text("not data")
    (src / ".hidden.jsonl").write_text("{not json")
    out = tmp_path / "out"
    summary = import_corpus(src, out, ImportConfig(name="dump", format="jsonl", id_field="id", eval_fraction=0.5, **KIND))
    assert summary["files"] == 2 and summary["files_left_aside"] == 1
    rows = _rows(out) + _rows(out, "eval")
    assert {r["source"] for r in rows} == {"a/part-1.jsonl.gz", "b/part-2.jsonl"}
    assert sorted(r["doc_id"] for r in rows) == sorted(f"d{i}" for i in range(20))


def test_lines_pyarrow_refuses_but_the_rules_allow_give_the_same_rows(tmp_path: Path) -> None:
    """Integer and string ids mixed in one chunk (pyarrow's reader wants one type per column) are
    read line by line: the result is the bytes of the same ids written as strings."""
    records = _docs(50)
    mixed = [{**r, "id": i} if i % 2 else {**r, "id": str(i)} for i, r in enumerate(records)]
    strings = [{**r, "id": str(i)} for i, r in enumerate(records)]
    _jsonl(tmp_path / "mixed" / "x.jsonl", mixed)
    (tmp_path / "mixed" / "x.jsonl").write_text(
        (tmp_path / "mixed" / "x.jsonl").read_text().replace("\n", "\n\n", 3))  # and blank lines
    _jsonl(tmp_path / "strings" / "x.jsonl", strings)
    config = ImportConfig(name="ids", format="jsonl", id_field="id", eval_fraction=0.2, **KIND)
    import_corpus(tmp_path / "mixed" / "x.jsonl", tmp_path / "a", config)
    import_corpus(tmp_path / "strings" / "x.jsonl", tmp_path / "b", config)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_blank_lines_keep_line_numbers_as_ids(tmp_path: Path) -> None:
    src = tmp_path / "x.jsonl"
    src.write_text('{"text": "first document here"}\n\n  \n{"text": "second document here"}\n{"text": "third, no newline"}')
    out = tmp_path / "out"
    import_corpus(src, out, ImportConfig(name="x", format="jsonl", eval_fraction=0.5, **KIND))
    ids = {r["text"]: r["doc_id"] for r in _rows(out) + _rows(out, "eval")}
    assert ids == {"first document here": "x.jsonl:1", "second document here": "x.jsonl:4", "third, no newline": "x.jsonl:5"}


def test_parquet_input_by_column_with_integer_ids_or_row_numbers(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    texts = [d["text"] for d in _docs(200)]
    pq.write_table(pa.table({"content": texts, "n": pa.array(range(1000, 1200), pa.int64())}), src / "p.parquet",
                   row_group_size=64)
    out = tmp_path / "out"
    import_corpus(src, out, ImportConfig(name="pq", format="parquet", text_field="content", id_field="n",
                                         eval_fraction=0.1, **KIND))
    rows = _rows(out) + _rows(out, "eval")
    assert sorted(int(r["doc_id"]) for r in rows) == list(range(1000, 1200))
    assert {r["doc_id"]: r["text"] for r in rows}["1005"] == texts[5]
    import_corpus(src, tmp_path / "out2", ImportConfig(name="pq", format="parquet", text_field="content",
                                                       eval_fraction=0.1, **KIND))
    assert {r["doc_id"] for r in _rows(tmp_path / "out2") + _rows(tmp_path / "out2", "eval")} == {
        f"p.parquet#{i}" for i in range(1, 201)}


def test_a_text_tree_is_one_document_per_file(tmp_path: Path) -> None:
    src = tmp_path / "notes"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("Alpha is the first letter of the Greek alphabet.\n")
    (src / "sub" / "b.md").write_text("\ufeffBeta comes second, after alpha.\n", encoding="utf-8")  # BOM dropped
    (src / "empty.txt").write_text("  \n")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    out = tmp_path / "out"
    import_corpus(src, out, ImportConfig(name="notes", format="text", eval_fraction=0.5, **KIND))
    rows = {r["doc_id"]: r for r in _rows(out) + _rows(out, "eval")}
    assert set(rows) == {"a.txt", "sub/b.md"}
    assert rows["sub/b.md"]["text"] == "Beta comes second, after alpha.\n" and rows["sub/b.md"]["source"] == "sub/b.md"


def test_the_held_out_split_is_a_keyed_hash_of_the_text(tmp_path: Path) -> None:
    records = _docs(2000)
    records += [{"id": f"copy{i}", "text": records[i]["text"]} for i in range(0, 2000, 10)]  # exact copies
    src = _jsonl(tmp_path / "in.jsonl", records)
    config = ImportConfig(name="split", format="jsonl", id_field="id", eval_fraction=0.1, **KIND)
    import_corpus(src, tmp_path / "s0", config)
    train, held_out = _rows(tmp_path / "s0"), _rows(tmp_path / "s0", "eval")
    assert not {r["text"] for r in train} & {r["text"] for r in held_out}, "a text is on one side only"
    assert 0.05 < len(held_out) / len(records) < 0.15
    import_corpus(src, tmp_path / "s1", ImportConfig(name="split", format="jsonl", id_field="id", eval_fraction=0.1,
                                                    seed=1, **KIND))
    assert {r["doc_id"] for r in _rows(tmp_path / "s1", "eval")} != {r["doc_id"] for r in held_out}


def test_shards_and_row_groups_end_after_the_row_that_fills_them(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", _docs(600))
    out = tmp_path / "out"
    import_corpus(src, out, ImportConfig(name="cut", format="jsonl", shard_bytes=10_000, eval_fraction=0.05, **KIND))
    shards = sorted((out / "train").glob("*.parquet"))
    assert [p.name for p in shards] == [f"shard-{i:05d}.parquet" for i in range(len(shards))]
    sizes = [sum(len(t.encode()) for t in pq.read_table(p, columns=["text"]).column("text").to_pylist()) for p in shards]
    longest = max(len(d["text"].encode()) for d in _docs(600))
    assert all(10_000 <= s < 10_000 + longest for s in sizes[:-1]) and 0 < sizes[-1] < 10_000 + longest
    assert MAX_SHARD_ROWS == 1_000_000  # the shipped contracts' row bound


def test_byte_sizes_parse_with_binary_units() -> None:
    assert [parse_byte_size(s) for s in ("1024", "64K", "64M", "1G", "2MiB")] == [1024, 65536, 64 << 20, 1 << 30, 2 << 20]
    with pytest.raises(ConfigError, match="'64 megs'"):
        parse_byte_size("64 megs")


# ----------------------------------------------------------------------------- memory is bounded

_PEAK = """
import sys
from pathlib import Path
import kiln.data.corpus_import as ci
ci.CHUNK_BYTES = ci.ROW_GROUP_TEXT_BYTES = 1 << 20
ci.import_corpus(Path(sys.argv[1]), Path(sys.argv[2]), ci.ImportConfig(name="m", format="jsonl", id_field="id",
                 kind="python-source", shard_bytes=2 << 20, eval_fraction=0.01))
# VmHWM: this process' own peak; ru_maxrss keeps the (pytest worker's) parent peak across exec
print(int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]) * 1024)
"""


def test_peak_memory_does_not_grow_with_the_input(tmp_path: Path) -> None:
    """5x the input (8 → 40 MiB) and the peak RSS stays where it was: the import holds one chunk and
    one pending row group, never the input. The chunk and row-group sizes are scaled down from 8 to
    1 MiB here so that a small input already reaches the steady state; ``benchmarks/corpus_import.py``
    measures the shipped sizes on hundreds of MB."""
    line = json.dumps({"id": "ID", "text": "document ID " + "x" * 3000})
    peaks = {}
    for mib in (8, 40):
        src = tmp_path / f"in-{mib}.jsonl"
        with src.open("w") as fh:
            for i in range(mib * 1024 * 1024 // 3030):
                fh.write(line.replace("ID", str(i)) + "\n")
        out = subprocess.run([sys.executable, "-c", _PEAK, str(src), str(tmp_path / f"out-{mib}")], capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        peaks[mib] = int(out.stdout.strip().splitlines()[-1])
        src.unlink()
    grown = peaks[40] - peaks[8]
    assert grown < 16 * 1024 * 1024, f"peak RSS grew by {grown / 2**20:.1f} MiB for 32 MiB more input: {peaks}"


# -------------------------------------------------------------------------------------- bad input


def _refused(tmp_path: Path, src: Path, config: ImportConfig, *expected: str) -> str:
    out = tmp_path / "corpora" / config.name
    with pytest.raises(CorpusInputError) as info:
        import_corpus(src, out, config)
    message = str(info.value)
    for part in expected:
        assert part in message, message
    assert _left_behind(tmp_path / "corpora") == [], "nothing half-written, no staging folder"
    return message


def _cfg(**kw: Any) -> ImportConfig:
    return ImportConfig(**{"name": "bad", "format": "jsonl", **KIND, **kw})


def test_a_missing_field_is_named_with_its_file_and_line(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [*_docs(5), {"body": "no text here"}, *_docs(5)])
    _refused(tmp_path, src, _cfg(), f"{src}:6: no field 'text'", "'body'")
    src = _jsonl(tmp_path / "ids.jsonl", [*_docs(3), {"text": "a document without an id field"}])
    _refused(tmp_path, src, _cfg(id_field="id"), f"{src}:4: no field 'id'")


def test_a_field_of_the_wrong_type_is_named(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [*_docs(2), {"text": 42}])
    _refused(tmp_path, src, _cfg(), f"{src}:3: field 'text' is a number, not a string")
    src = _jsonl(tmp_path / "null.jsonl", [{"text": None}])
    _refused(tmp_path, src, _cfg(), f"{src}:1: field 'text' is null")
    src = _jsonl(tmp_path / "id.jsonl", [*_docs(2), {"id": 1.5, "text": "a float is no id for a document"}])
    _refused(tmp_path, src, _cfg(id_field="id"), f"{src}:3: field 'id' is a number, not a string or an integer")


def test_bytes_that_are_not_utf8_are_named_by_line_and_column(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "fine first document"}\n{"text": "caf\xe9 latin-1"}\n')
    _refused(tmp_path, src, _cfg(), f"{src}:2: bytes that are not UTF-8 (0xe9 at column 14")
    src = tmp_path / "surrogate.jsonl"
    src.write_text('{"text": "ok document here"}\n{"text": "lone \\ud800 surrogate"}\n')
    _refused(tmp_path, src, _cfg(), f"{src}:2: field 'text' holds a lone surrogate", "not UTF-8")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "ok.txt").write_text("a good text file of some length\n")
    (tree / "latin.txt").write_bytes(b"line one\nline two\nna\xefve\n")
    _refused(tmp_path, tree, _cfg(format="text"), f"{tree / 'latin.txt'}:3: bytes that are not UTF-8")


def test_a_line_that_is_not_one_json_object_is_named(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "first document text"}\n{"text": "second", }\n')
    _refused(tmp_path, src, _cfg(), f"{src}:2: not valid JSON")
    src.write_text('{"text": "first document text"}\n["an", "array"]\n')
    _refused(tmp_path, src, _cfg(), f"{src}:2: a line must hold one JSON object, not an array")
    src.write_text('{"text": "one", "text": "two"}\n')
    _refused(tmp_path, src, _cfg(), f"{src}:1: field 'text' appears twice")
    src.write_text('{"id": "1", "text": "first document text"}\n{"id": "2", "text": "a"} {"id": "3", "text": "b"}\n')
    _refused(tmp_path, src, _cfg(id_field="id"), f"{src}:2: not valid JSON (Extra data")  # two objects, one line


def test_hostile_json_structure_in_a_line_is_named_not_a_traceback(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    good = '{"text": "first document text"}\n'
    src.write_text(good + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    _refused(tmp_path, src, _cfg(), f"{src}:2: not valid JSON (nested deeper than 64 levels")
    src.write_text(good + '{"text": ' + "[" * 100_000 + "\n")
    _refused(tmp_path, src, _cfg(), f"{src}:2: not valid JSON (nested deeper than 64 levels")
    src.write_text(good + '{"text": ' + "9" * 5000 + "}\n")
    _refused(tmp_path, src, _cfg(), f"{src}:2: not valid JSON (a number has more than 100 digits")
    src.write_text(good + '{"text": NaN}\n')
    _refused(tmp_path, src, _cfg(), f"{src}:2: not valid JSON (NaN is not a JSON number")


def test_an_unreadable_or_truncated_file_is_named(tmp_path: Path) -> None:
    tree = tmp_path / "in"
    _jsonl(tree / "a.jsonl", _docs(3))
    os.mkfifo(tree / "c.jsonl")  # a link is skipped, not read (test_corpus_import_inputs.py)
    _refused(tmp_path, tree, _cfg(), f"{tree / 'c.jsonl'}: not a regular file")
    (tree / "c.jsonl").unlink()
    whole = gzip.compress(b"".join(json.dumps(d).encode() + b"\n" for d in _docs(2000)))
    (tree / "d.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    _refused(tmp_path, tree, _cfg(), f"{tree / 'd.jsonl.gz'}: cannot read past line", "Truncated")
    _refused(tmp_path, tmp_path / "nowhere", _cfg(), f"{tmp_path / 'nowhere'}: cannot read the input")


def test_an_empty_input_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _refused(tmp_path, empty, _cfg(), f"{empty}: empty input")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n   \n")
    _refused(tmp_path, blank, _cfg(), f"{blank}: empty input")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.md").write_text("no jsonl here")
    _refused(tmp_path, folder, _cfg(), f"{folder}: empty input: no *.jsonl", "1 other file(s) left aside")
    one = _jsonl(tmp_path / "one.jsonl", _docs(1))
    _refused(tmp_path, one, _cfg(eval_fraction=0.01), "1 document(s) leave the held-out split empty")


def test_parquet_problems_are_named_by_file_and_row(tmp_path: Path) -> None:
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"body": ["a document of text"]}), src)
    _refused(tmp_path, src, _cfg(format="parquet"), f"{src}: no column 'text' (columns: body)")
    pq.write_table(pa.table({"text": ["a document of text", None, "x"]}), src)
    _refused(tmp_path, src, _cfg(format="parquet"), f"{src}: row 2: column 'text' is null")
    pq.write_table(pa.table({"text": pa.array([b"fine text here", b"caf\xe9"], pa.binary())}), src)
    _refused(tmp_path, src, _cfg(format="parquet"), f"{src}: row 2: column 'text' holds bytes that are not UTF-8")
    pq.write_table(pa.table({"text": [1, 2]}), src)
    _refused(tmp_path, src, _cfg(format="parquet"), f"{src}: column 'text' is int64, not a string")
    src.write_bytes(b"PAR1 this is not parquet")
    _refused(tmp_path, src, _cfg(format="parquet"), f"{src}: not a readable Parquet file")


@pytest.mark.parametrize("name", ["Bad Name", "../escape", "", "-x", "a" * 65, "UPPER", "trailing\n"])
def test_a_name_that_is_not_a_safe_identifier_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="not a safe corpus name"):
        ImportConfig(name=name, format="jsonl")


def test_an_existing_corpus_is_replaced_only_when_asked_and_a_failed_import_keeps_it(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", _docs(100))
    out = tmp_path / "corpora" / "mine"
    config = _cfg(name="mine", eval_fraction=0.1)
    import_corpus(src, out, config)
    before = _files(out)
    with pytest.raises(ConfigError, match="exists: pass --replace"):
        import_corpus(src, out, config)
    bad = _jsonl(tmp_path / "bad.jsonl", [*_docs(50), {"oops": 1}])
    with pytest.raises(CorpusInputError, match=":51: no field 'text'"):
        import_corpus(bad, out, config, replace=True)
    assert _files(out) == before and _left_behind(tmp_path / "corpora") == ["mine"]
    (tmp_path / "corpora" / "other").mkdir()
    (tmp_path / "corpora" / "other" / "data.bin").write_bytes(b"not a corpus")
    with pytest.raises(ConfigError, match="not a kiln corpus"):
        import_corpus(src, tmp_path / "corpora" / "other", config, replace=True)


def test_the_cli_prints_one_error_line_and_exit_2_for_bad_input(tmp_path: Path, capsys, monkeypatch) -> None:
    from kiln.cli import main

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    src = _jsonl(tmp_path / "in.jsonl", [*_docs(3), {"txt": "typo"}])
    code = main(["corpus", "import", str(src), "--name", "mine", "--format", "jsonl", "--kind", "python-source"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("kiln corpus import: error: ") and f"{src}:4" in err[0]
    assert not (tmp_path / "home" / "dvc-repo" / "corpora" / "mine").exists()
    code = main(["corpus", "import", str(_jsonl(tmp_path / "ok.jsonl", _docs(40))), "--name", "mine", "--format", "jsonl",
                 "--kind", "python-source", "--eval-fraction", "0.2", "--shard-bytes", "2K"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["out"] == str(tmp_path / "home" / "dvc-repo" / "corpora" / "mine")
    assert len(summary["train"]["shards"]) > 1


def test_a_full_disk_leaves_nothing_and_keeps_the_corpus_it_would_have_replaced(tmp_path: Path, tmpfs) -> None:
    from kiln.errors import KilnError

    disk = tmpfs("1m")
    small = _jsonl(tmp_path / "small.jsonl", _docs(50))
    config = _cfg(name="mine", eval_fraction=0.1)
    import_corpus(small, disk / "mine", config)
    before = _files(disk / "mine")
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": f"{i} " + os.urandom(1500).hex()}) + "\n" for i in range(1000)))
    with pytest.raises(KilnError, match="No space left on device") as info:
        import_corpus(big, disk / "mine", config, replace=True)
    assert not isinstance(info.value, CorpusInputError) and "left as it was" in str(info.value)
    assert _files(disk / "mine") == before and _left_behind(disk) == ["mine"]
    with pytest.raises(KilnError, match="No space left on device"):
        import_corpus(big, disk / "other", config)
    assert _left_behind(disk) == ["mine"]

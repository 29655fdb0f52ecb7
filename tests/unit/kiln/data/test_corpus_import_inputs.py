"""``kiln corpus import`` reads only its input, where it is, within caps, and replaces only a corpus
kiln wrote: links skipped and named, devices and FIFOs refused, names that are not UTF-8 named, a
gzip bomb stopped at the line cap, ``--replace`` refusing a folder of someone's files, staging
folders no other corpus can match, and a replace killed at any step leaving a corpus visible."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data import corpus_import
from kiln.data.corpora import read_metadata
from kiln.data.corpus_import import ImportConfig, import_corpus
from kiln.errors import ConfigError, CorpusInputError

KIND = {"kind": "python-source"}


def _cfg(**kw: Any) -> ImportConfig:
    return ImportConfig(**{"name": "mine", "format": "jsonl", "eval_fraction": 0.2, **KIND, **kw})


def _docs(n: int) -> list[dict[str, Any]]:
    return [{"id": f"d{i}", "text": f"Document {i}: " + "the quick brown fox jumps. " * (1 + i % 5)} for i in range(n)]


def _jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _texts(out: Path) -> list[str]:
    return [r["text"] for split in ("train", "eval") for p in sorted((out / split).glob("*.parquet"))
            for r in pq.read_table(p).to_pylist()]


def _sources(out: Path) -> set[str]:
    return {r["source"] for split in ("train", "eval") for p in sorted((out / split).glob("*.parquet"))
            for r in pq.read_table(p).to_pylist()}


def _text_tree(root: Path, n: int = 30) -> Path:
    for i in range(n):
        (root / f"doc{i:02d}.txt").parent.mkdir(parents=True, exist_ok=True)
        (root / f"doc{i:02d}.txt").write_text(f"document {i} of plain prose and nothing else\n")
    return root


# -- reading only the input, only regular files --------------------------------------------------------


def test_a_link_inside_a_text_tree_is_skipped_and_named_never_read(tmp_path: Path) -> None:
    tree = _text_tree(tmp_path / "in")
    (tmp_path / "outside.txt").write_text("PASSWORD=hunter2 from outside the tree")
    (tree / "environ").symlink_to("/proc/self/environ")
    (tree / "outside.txt").symlink_to(tmp_path / "outside.txt")
    (tree / "inside.txt").symlink_to(tree / "doc00.txt")  # even one inside the tree: no link is followed
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret.txt").write_text("a hidden-away note from a linked folder")
    (tree / "folder").symlink_to(tmp_path / "elsewhere")
    os.environ["KILN_TEST_SECRET"] = "hunter2-in-the-environment"
    try:
        summary = import_corpus(tree, tmp_path / "corpora" / "mine", _cfg(format="text"))
    finally:
        del os.environ["KILN_TEST_SECRET"]
    out = tmp_path / "corpora" / "mine"
    texts = "\n".join(_texts(out))
    assert "hunter2" not in texts and "hidden-away" not in texts
    assert _sources(out) == {f"doc{i:02d}.txt" for i in range(30)}
    skipped = {Path(e["path"]).name: e["reason"] for e in summary["skipped"]}
    assert set(skipped) == {"environ", "outside.txt", "inside.txt", "folder"}
    assert skipped["environ"].startswith("a symlink (-> /proc/self/environ)")
    assert read_metadata(out).source["symlinks_skipped"] == 4


def test_a_fifo_a_socket_or_a_device_is_refused_naming_its_kind(tmp_path: Path) -> None:
    tree = _text_tree(tmp_path / "in")
    os.mkfifo(tree / "pipe.txt")
    with pytest.raises(CorpusInputError, match=r"pipe\.txt: not a regular file but a FIFO"):
        import_corpus(tree, tmp_path / "corpora" / "mine", _cfg(format="text"))
    (tree / "pipe.txt").unlink()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tree / "sock.txt"))
        with pytest.raises(CorpusInputError, match=r"sock\.txt: not a regular file but a socket"):
            import_corpus(tree, tmp_path / "corpora" / "mine", _cfg(format="text"))
    with pytest.raises(CorpusInputError, match="/dev/zero: the input is a character device"):
        import_corpus("/dev/zero", tmp_path / "corpora" / "mine", _cfg())
    assert not (tmp_path / "corpora" / "mine").exists()


def test_a_jsonl_link_to_dev_zero_is_skipped_not_read(tmp_path: Path) -> None:
    tree = tmp_path / "in"
    _jsonl(tree / "a.jsonl", _docs(40))
    (tree / "b.jsonl").symlink_to("/dev/zero")
    summary = import_corpus(tree, tmp_path / "corpora" / "mine", _cfg())
    assert [Path(e["path"]).name for e in summary["skipped"]] == ["b.jsonl"]
    assert summary["train"]["documents"] + summary["eval"]["documents"] == 40


def test_the_input_named_on_the_command_line_may_itself_be_a_link(tmp_path: Path) -> None:
    real = _jsonl(tmp_path / "real.jsonl", _docs(40))
    (tmp_path / "given.jsonl").symlink_to(real)
    summary = import_corpus(tmp_path / "given.jsonl", tmp_path / "corpora" / "mine", _cfg())
    assert summary["skipped"] == [] and summary["train"]["documents"] + summary["eval"]["documents"] == 40


def test_a_file_swapped_after_it_was_listed_is_refused(tmp_path: Path, monkeypatch) -> None:
    tree = tmp_path / "in"
    _jsonl(tree / "a.jsonl", _docs(40))
    listed = corpus_import._input_files

    def list_then_swap(src: Path, fmt: Any) -> Any:
        found = listed(src, fmt)
        (tree / "a.jsonl").unlink()
        (tree / "a.jsonl").symlink_to("/proc/self/environ")
        return found

    monkeypatch.setattr(corpus_import, "_input_files", list_then_swap)
    with pytest.raises(CorpusInputError, match=r"a\.jsonl: cannot read: is a symlink"):
        import_corpus(tree, tmp_path / "corpora" / "mine", _cfg())
    (tree / "a.jsonl").unlink()
    _jsonl(tree / "b.jsonl", _docs(40))

    def list_then_replace(src: Path, fmt: Any) -> Any:
        found = listed(src, fmt)
        _jsonl(tree / "new.jsonl", _docs(3))
        os.replace(tree / "new.jsonl", tree / "b.jsonl")
        return found

    monkeypatch.setattr(corpus_import, "_input_files", list_then_replace)
    with pytest.raises(CorpusInputError, match=r"b\.jsonl: the file was replaced while the input was read"):
        import_corpus(tree, tmp_path / "corpora" / "mine", _cfg())


def test_a_name_that_is_not_utf8_is_refused_naming_its_bytes(tmp_path: Path) -> None:
    tree = _text_tree(tmp_path / "in")
    (tree / os.fsdecode(b"caf\xe9.txt")).write_text("a document under a Latin-1 name")
    with pytest.raises(CorpusInputError, match=r"caf\\xe9\.txt: the name is not UTF-8 \(byte 0xe9\)"):
        import_corpus(tree, tmp_path / "corpora" / "mine", _cfg(format="text"))
    (tree / os.fsdecode(b"caf\xe9.txt")).unlink()
    (tree / os.fsdecode(b"dir\xff")).mkdir()
    (tree / os.fsdecode(b"dir\xff") / "a.txt").write_text("a document in a folder with a bad name")
    with pytest.raises(CorpusInputError, match=r"dir\\xff: the name is not UTF-8 \(byte 0xff\)"):
        import_corpus(tree, tmp_path / "corpora" / "mine", _cfg(format="text"))


def test_the_cli_names_a_file_name_that_is_not_utf8_in_one_error_line(tmp_path: Path, capsys, monkeypatch) -> None:
    from kiln.cli import main

    tree = tmp_path / "in"
    _jsonl(tree / os.fsdecode(b"x\xe9.jsonl"), _docs(5))
    code = main(["corpus", "import", str(tree), "--name", "mine", "--format", "jsonl", "--kind", "python-source",
                 "--root", str(tmp_path / "corpora")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("kiln corpus import: error: ") and "not UTF-8" in err[0]


def test_the_cli_names_each_skipped_link_on_stderr(tmp_path: Path, capsys) -> None:
    from kiln.cli import main

    tree = tmp_path / "in"
    _jsonl(tree / "a.jsonl", _docs(40))
    (tree / "b.jsonl").symlink_to("/proc/self/environ")
    code = main(["corpus", "import", str(tree), "--name", "mine", "--format", "jsonl", "--kind", "python-source",
                 "--eval-fraction", "0.2", "--root", str(tmp_path / "corpora")])
    captured = capsys.readouterr()
    assert code == 0 and f"skipped {tree / 'b.jsonl'}: a symlink (-> /proc/self/environ)" in captured.err
    assert json.loads(captured.out)["skipped"][0]["path"] == str(tree / "b.jsonl")


def test_a_parquet_file_with_two_text_columns_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "two.parquet"
    table = pa.Table.from_arrays([pa.array(["one document"]), pa.array(["another"])], names=["text", "text"])
    pq.write_table(table, src)
    with pytest.raises(CorpusInputError, match=r"two\.parquet: column 'text' appears 2 times"):
        import_corpus(src, tmp_path / "corpora" / "mine", _cfg(format="parquet"))


def test_the_corpus_may_not_be_written_inside_its_input(tmp_path: Path) -> None:
    tree = tmp_path / "in"
    _jsonl(tree / "a.jsonl", _docs(40))
    with pytest.raises(ConfigError, match="lies inside the input"):
        import_corpus(tree, tree / "corpora" / "mine", _cfg())
    assert sorted(p.name for p in tree.iterdir()) == ["a.jsonl"]


# -- caps -------------------------------------------------------------------------------------------


def test_a_line_over_the_cap_is_refused_naming_the_cap_and_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(corpus_import, "MAX_LINE_BYTES", 100_000)
    monkeypatch.setattr(corpus_import, "CHUNK_BYTES", 16_384)
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 200_000}) + "\n")
    with pytest.raises(CorpusInputError, match=r"long\.jsonl:2: the line is longer than 100000 bytes"):
        import_corpus(src, tmp_path / "corpora" / "mine", _cfg())


@pytest.mark.parametrize("over", [1, 5_000, 16_383])
def test_a_line_over_the_cap_is_refused_also_when_its_newline_comes_in_the_chunk_that_crosses_the_cap(
        tmp_path: Path, monkeypatch, over: int) -> None:
    monkeypatch.setattr(corpus_import, "MAX_LINE_BYTES", 100_000)
    monkeypatch.setattr(corpus_import, "CHUNK_BYTES", 16_384)
    src = tmp_path / "long.jsonl"
    line = json.dumps({"text": "x" * 100_000})
    src.write_text(json.dumps({"text": "short"}) + "\n" + line[: 100_000 - 2] + "x" * over + line[-2:] + "\n")
    with pytest.raises(CorpusInputError, match=r"long\.jsonl:2: the line is longer than 100000 bytes"):
        import_corpus(src, tmp_path / "corpora" / "mine", _cfg())


def test_a_line_at_the_cap_is_read(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(corpus_import, "MAX_LINE_BYTES", 100_000)
    monkeypatch.setattr(corpus_import, "CHUNK_BYTES", 16_384)
    src = tmp_path / "long.jsonl"
    docs = [json.dumps({"text": f"short {i}"}) for i in range(20)]
    src.write_text("\n".join([*docs, json.dumps({"text": "x" * (100_000 - 12)})]) + "\n")
    assert len(src.read_text().splitlines()[-1]) == 100_000
    import_corpus(src, tmp_path / "corpora" / "mine", _cfg())
    assert "x" * (100_000 - 12) in _texts(tmp_path / "corpora" / "mine")


def test_a_file_that_decompresses_past_the_cap_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(corpus_import, "MIN_DECOMPRESSED_CAP", 1_000_000)
    src = tmp_path / "bomb.jsonl.gz"
    src.write_bytes(gzip.compress(b"".join(json.dumps({"text": "a" * 1000}).encode() + b"\n" for _ in range(5000))))
    assert src.stat().st_size * 200 < 5_000_000
    cap = r"decompresses to more than \d+ bytes \(the cap: 200x the compressed size, at least 1000000\)"
    with pytest.raises(CorpusInputError, match=r"bomb\.jsonl\.gz: " + cap):
        import_corpus(src, tmp_path / "corpora" / "mine", _cfg())


_BOMB_CHILD = """
import sys
from kiln.data.corpus_import import ImportConfig, import_corpus
from kiln.errors import CorpusInputError
try:
    import_corpus(sys.argv[1], sys.argv[2], ImportConfig(name="mine", format="jsonl", kind="python-source"))
except CorpusInputError as exc:
    print(exc)
# VmHWM: this process' own peak; ru_maxrss keeps the (pytest worker's) parent peak across exec
print(int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]) // 1024)
"""


def test_a_one_line_gzip_bomb_stops_at_the_line_cap_in_bounded_memory(tmp_path: Path) -> None:
    """A bound, not a benchmark: 512 MiB of one line, 500 KB compressed, must not be held whole."""
    src = tmp_path / "bomb.jsonl.gz"
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"a" * (1 << 20)
    with open(src, "wb") as fh:
        fh.write(packer.compress(b'{"text": "'))
        for _ in range(512):
            fh.write(packer.compress(block))
        fh.write(packer.flush())
    assert src.stat().st_size < 1_000_000
    done = subprocess.run([sys.executable, "-c", _BOMB_CHILD, str(src), str(tmp_path / "corpora" / "mine")],
                          capture_output=True, text=True, timeout=300, check=True)
    message, peak_mib = done.stdout.strip().splitlines()
    assert f"bomb.jsonl.gz:1: the line is longer than {corpus_import.MAX_LINE_BYTES} bytes" in message
    assert int(peak_mib) < 900, f"peak RSS {peak_mib} MiB"


# -- replacing only what kiln wrote -----------------------------------------------------------------


def _someones_folder(path: Path) -> dict[str, bytes]:
    (path / "train").mkdir(parents=True)
    (path / "val").mkdir()
    (path / "images").mkdir()
    (path / "NOTES.md").write_text("my notes")
    (path / "train" / "part-0.parquet").write_bytes(b"mine")
    (path / "val" / "part-0.parquet").write_bytes(b"mine too")
    (path / "images" / "cat.png").write_bytes(b"\x89PNG")
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_replace_refuses_a_folder_that_is_not_a_kiln_corpus_and_says_why(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", _docs(40))
    folder = tmp_path / "corpora" / "mine"
    before = _someones_folder(folder)
    with pytest.raises(ConfigError, match=r"is not a kiln corpus: no corpus\.json, the record kiln writes"):
        import_corpus(src, folder, _cfg(), replace=True)
    after = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    assert after == before


def test_replace_refuses_a_kiln_corpus_holding_files_kiln_did_not_write(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", _docs(40))
    out = tmp_path / "corpora" / "mine"
    import_corpus(src, out, _cfg())
    (out / "NOTES.md").write_text("my notes")
    (out / "train" / "extra.parquet").write_bytes(b"mine")
    with pytest.raises(ConfigError, match=r"holds files kiln did not write there \(NOTES\.md, train/extra\.parquet\)"):
        import_corpus(src, out, _cfg(), replace=True)
    assert (out / "NOTES.md").read_text() == "my notes"
    (out / "NOTES.md").unlink()
    (out / "train" / "extra.parquet").unlink()
    (out / "corpus.json").write_text("{not json")
    with pytest.raises(ConfigError, match="its record cannot be read"):
        import_corpus(src, out, _cfg(), replace=True)


def test_staging_folders_of_another_corpus_are_never_touched(tmp_path: Path) -> None:
    """Corpus ``a`` must neither delete nor adopt the staging or aside folders of corpus ``a.new-b``."""
    src = _jsonl(tmp_path / "in.jsonl", _docs(40))
    root = tmp_path / "corpora"
    other = root / "a.new-b"
    theirs = [root / f"{corpus_import._staging_prefix(other, role)}xyz12345" for role in ("new", "old")]
    for folder in theirs:
        folder.mkdir(parents=True)
        (folder / "corpus.json").write_text("{}")
    import_corpus(src, root / "a", _cfg(name="a"))
    import_corpus(src, root / "a", _cfg(name="a"), replace=True)
    (root / "a.old-x").mkdir()  # a plain folder named like an old-style aside
    import_corpus(src, root / "a", _cfg(name="a"), replace=True)
    assert all((folder / "corpus.json").read_text() == "{}" for folder in theirs)
    assert sorted(p.name for p in root.iterdir()) == sorted(["a", "a.old-x", *(f.name for f in theirs)])


_KILL_CHILD = """
import os, shutil, sys
from pathlib import Path
from kiln.data import corpus_import
from kiln.data.corpus_import import ImportConfig, import_corpus

kill_at, fallback = int(sys.argv[3]), sys.argv[4] == "fallback"
calls = [0]

def killing(real):
    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == kill_at:
            os._exit(137)  # a kill: no handler, no cleanup runs
        return real(*args, **kwargs)
    return step

def no_exchange(a, b):
    raise OSError(22, "Invalid argument")

if fallback:
    corpus_import.exchange_paths = no_exchange
os.replace = killing(os.replace)
shutil.rmtree = killing(shutil.rmtree)
corpus_import.exchange_paths = killing(corpus_import.exchange_paths)
corpus_import.fsync_dir = killing(corpus_import.fsync_dir)
corpus_import.write_metadata = killing(corpus_import.write_metadata)
import_corpus(sys.argv[1], sys.argv[2], ImportConfig(name="mine", format="jsonl", kind="python-source",
              eval_fraction=0.2), replace=True)
print(calls[0])
"""


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_a_replace_killed_at_any_step_leaves_a_corpus_visible_and_a_rerun_recovers(tmp_path: Path, mode: str) -> None:
    old_src = _jsonl(tmp_path / "old.jsonl", _docs(40))
    new_src = _jsonl(tmp_path / "new.jsonl", _docs(60))
    root = tmp_path / "corpora"
    out = root / "mine"
    import_corpus(old_src, out, _cfg())
    old_docs, new_docs = 40, 60
    step = 1
    while True:
        done = subprocess.run([sys.executable, "-c", _KILL_CHILD, str(new_src), str(out), str(step), mode],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode in (0, 137), done.stderr
        meta = read_metadata(out) if out.exists() else None
        visible = None if meta is None else meta.train.documents + meta.eval.documents
        if mode == "exchange":
            assert visible in (old_docs, new_docs), f"killed at step {step}: no corpus at {out}"
        else:  # two renames: between them the old corpus is aside until the next import puts it back
            assert visible in (old_docs, new_docs) or any(p.name.startswith(".kiln-import-mine~old~") for p in root.iterdir())
        summary = import_corpus(new_src, out, _cfg(), replace=True)  # the re-run recovers, and finishes
        assert summary["train"]["documents"] + summary["eval"]["documents"] == new_docs
        assert sorted(p.name for p in root.iterdir()) == ["mine"], f"left behind after a kill at step {step}"
        import_corpus(old_src, out, _cfg(), replace=True)
        if done.returncode == 0:
            break
        step += 1
    assert step > 3

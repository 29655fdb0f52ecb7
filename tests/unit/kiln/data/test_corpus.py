"""``kiln.data.corpus``: the stdlib sample corpus, its determinism, the eval split, poison placement."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data import corpus
from kiln.data.corpus import MAX_DOC_BYTES, POISON_KINDS, build_corpus
from kiln.errors import ConfigError


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _rows(path: str | Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


def test_same_arguments_give_byte_identical_files(clean_corpus: dict[str, Any], tmp_path: Path) -> None:
    again = build_corpus(tmp_path / "again")
    first, second = _files(Path(clean_corpus["out"])), _files(Path(again["out"]))
    assert first == second
    assert len(first) == 8 + 1 + 1  # shards, the eval split, corpus.json
    # Rebuilding in place is idempotent too.
    build_corpus(tmp_path / "again")
    assert _files(tmp_path / "again") == first


def test_another_seed_gives_another_split(clean_corpus: dict[str, Any], tmp_path: Path) -> None:
    other = build_corpus(tmp_path / "seed1", seed=1, max_bytes=256 * 1024)
    ids_0 = {r["doc_id"] for r in _rows(clean_corpus["eval"][0])}
    ids_1 = {r["doc_id"] for r in _rows(other["eval"][0])}
    assert ids_0 != ids_1


def test_layout_schema_and_documents(clean_corpus: dict[str, Any]) -> None:
    out = Path(clean_corpus["out"])
    assert [Path(p).name for p in clean_corpus["train"]] == [f"shard-{i:05d}.parquet" for i in range(8)]
    assert clean_corpus["eval"] == [str(out / "eval" / "eval-00000.parquet")]
    schema = pq.read_schema(clean_corpus["train"][0])
    assert [(f.name, f.type) for f in schema] == [("doc_id", pa.string()), ("text", pa.string()), ("source", pa.string())]
    rows = [r for p in clean_corpus["train"] for r in _rows(p)]
    assert len(rows) == clean_corpus["documents"]["train"]
    assert len({r["doc_id"] for r in rows}) == len(rows), "doc ids are unique across the whole corpus"
    for r in rows:
        assert r["doc_id"].startswith(r["source"] + "#")
        assert r["source"].endswith(".py")
        assert 0 < len(r["text"].encode("utf-8")) <= MAX_DOC_BYTES
    # The text is the real file content, chunked at line boundaries.
    first = rows[0]
    original = (Path(clean_corpus["stdlib"]) / first["source"]).read_text(encoding="utf-8")
    assert first["text"] in original and first["text"].endswith("\n")


def test_default_corpus_is_demo_sized(clean_corpus: dict[str, Any]) -> None:
    assert 500_000 < clean_corpus["bytes"] < 4_000_000
    per_shard = [pq.read_metadata(p).num_rows for p in clean_corpus["train"]]
    assert max(per_shard) - min(per_shard) <= 1
    meta = pq.read_metadata(clean_corpus["train"][0])
    assert meta.row_group(0).num_rows == min(meta.num_rows, corpus.ROW_GROUP_SIZE)


def test_eval_split_never_overlaps_training(clean_corpus: dict[str, Any]) -> None:
    train = [r for p in clean_corpus["train"] for r in _rows(p)]
    held_out = _rows(clean_corpus["eval"][0])
    assert held_out
    assert not {r["source"] for r in train} & {r["source"] for r in held_out}
    assert not {r["doc_id"] for r in train} & {r["doc_id"] for r in held_out}
    assert not {r["text"] for r in train} & {r["text"] for r in held_out}
    share = clean_corpus["text_bytes"]["eval"] / sum(clean_corpus["text_bytes"].values())
    assert 0.05 < share < 0.2


def test_poison_map_is_returned_but_never_written_inside_the_corpus(poisoned_corpus: dict[str, Any]) -> None:
    out = Path(poisoned_corpus["out"])
    assert sorted(poisoned_corpus["poisoned"].values()) == sorted(POISON_KINDS)
    names = set(_files(out))
    assert names == {f"train/shard-{i:05d}.parquet" for i in range(20)} | {"eval/eval-00000.parquet", "corpus.json"}
    assert not {kind for kind in POISON_KINDS if kind in (out / "corpus.json").read_text()}, "the record names no poison"
    json.dumps(poisoned_corpus)  # the summary is JSON-safe (the CLI prints it)


def test_poison_positions_are_seeded_and_deterministic() -> None:
    kinds = ["secret", "zero_bytes", "wrong_type"]
    assert corpus._poison_positions(kinds, 8, seed=3) == corpus._poison_positions(kinds, 8, seed=3)
    placements = {tuple(sorted(corpus._poison_positions(kinds, 8, seed=s))) for s in range(10)}
    assert len(placements) > 1


@pytest.mark.parametrize("seed", range(12))
def test_cross_shard_duplicate_always_follows_a_clean_donor(seed: int) -> None:
    # Every shard but one poisoned: the duplicate must still come after the single clean shard,
    # otherwise the healthy donor would be the one blamed for the collision.
    kinds = ["duplicate_ids_across_shards"] + ["zero_bytes"] * 4
    chosen = corpus._poison_positions(kinds, 6, seed)
    dup = next(pos for pos, kind in chosen.items() if kind == "duplicate_ids_across_shards")
    clean = [i for i in range(6) if i not in chosen]
    assert any(c < dup for c in clean)


def test_poisons_leave_the_other_shards_untouched(clean_corpus: dict[str, Any], tmp_path: Path) -> None:
    out = build_corpus(tmp_path / "p", poison=["secret", "zero_bytes"])
    clean_files, poisoned_files = _files(Path(clean_corpus["out"])), _files(tmp_path / "p")
    changed = {name for name in clean_files if clean_files[name] != poisoned_files[name]}
    assert changed == set(out["poisoned"])


def test_rebuild_with_fewer_shards_removes_stale_ones(tmp_path: Path) -> None:
    build_corpus(tmp_path / "c", shards=6, max_bytes=128 * 1024)
    build_corpus(tmp_path / "c", shards=3, max_bytes=128 * 1024)
    assert sorted(p.name for p in (tmp_path / "c" / "train").iterdir()) == [f"shard-{i:05d}.parquet" for i in range(3)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"poison": ["no_such_poison"]}, "unknown poison"),
        ({"shards": 0}, "shards must be"),
        ({"shards": 2, "poison": ["secret", "zero_bytes", "truncated"]}, "at least as many shards"),
        ({"shards": 2, "poison": ["duplicate_ids_across_shards", "secret"]}, "clean shard"),
        ({"shards": 5000, "max_bytes": 64 * 1024}, "cannot fill"),
        ({"max_bytes": 10}, "max_bytes"),
    ],
)
def test_bad_arguments_are_config_errors(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_corpus(tmp_path / "bad", **kwargs)


def test_cli_help_lists_every_poison_kind(kiln_cli, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        kiln_cli(["corpus", "build", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for kind in POISON_KINDS.values():
        assert kind.name in text and kind.description in text


def test_cli_build_prints_the_summary(kiln_cli, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = kiln_cli(
        ["corpus", "build", "--out", str(tmp_path / "c"), "--shards", "4", "--seed", "2", "--max-bytes", "200000",
         "--poison", "secret", "zero_rows", "--poison", "truncated"]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(tmp_path / "c") and len(summary["train"]) == 4
    assert sorted(summary["poisoned"].values()) == ["secret", "truncated", "zero_rows"]


def test_cli_usage_errors_exit_2(kiln_cli, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        kiln_cli(["corpus", "build", "--out", str(tmp_path), "--poison", "nonsense"])
    assert exit_info.value.code == 2
    assert kiln_cli(["corpus", "build", "--out", str(tmp_path / "c"), "--shards", "0"]) == 2
    assert "shards must be" in capsys.readouterr().err


def test_exact_duplicate_documents_are_kept_once(tmp_path: Path) -> None:
    # Generated stdlib modules (codec tables) share whole chunks; a copy in each split would be
    # contamination by construction. Any text may appear only once in the whole corpus.
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    shared = ""
    while len(shared) < 4000:  # one whole chunk: the next (long) line no longer fits in 4 KiB
        shared += f"VALUE_{len(shared)} = 1  # a line that is long enough to matter\n"
    for i in range(60):
        unique = "".join(f"def function_{i}_{j}_with_a_rather_long_name_for_padding():  # pad pad pad pad\n" for j in range(40))
        (stdlib / f"mod_{i:02d}.py").write_text(shared + unique)
    summary = build_corpus(tmp_path / "c", shards=2, max_bytes=10**7, stdlib_dir=stdlib)
    texts = [r["text"] for p in summary["train"] + summary["eval"] for r in _rows(p)]
    assert len(texts) == len(set(texts))
    assert sum(t == shared for t in texts) == 1
    assert summary["documents"]["eval"] > 0 and summary["documents"]["train"] > 0


def test_every_document_text_is_unique(clean_corpus: dict[str, Any]) -> None:
    texts = [r["text"] for p in clean_corpus["train"] + clean_corpus["eval"] for r in _rows(p)]
    assert len(texts) == len(set(texts))


def test_the_sample_corpus_records_its_kind_and_contract(clean_corpus: dict[str, Any]) -> None:
    from kiln.data.corpora import read_metadata

    meta = read_metadata(clean_corpus["out"])
    assert meta is not None and (meta.kind, meta.contract, meta.producer) == ("python-source", "stdlib-py@1",
                                                                              "kiln corpus build")
    assert (meta.train.shards, meta.train.documents, meta.eval.documents) == (
        8, clean_corpus["documents"]["train"], clean_corpus["documents"]["eval"])
    assert clean_corpus["stdlib"] not in Path(clean_corpus["out"], "corpus.json").read_text()

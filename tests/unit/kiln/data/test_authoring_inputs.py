"""``kiln contract init`` on ordinary corpora that mix Arrow string types or hold an empty shard."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.cli import main
from kiln.data.contracts import contract_problems

from webtext_fixtures import prose_documents


def _texts(n: int) -> list[str]:
    return [text for _id, text, _source in prose_documents()[:n]]


def _shard(path: Path, texts: list[str], text_type: pa.DataType | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = [f"{path.stem}-{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"doc_id": pa.array(ids, pa.string()), "text": pa.array(texts, text_type or pa.string())}), path)


def _init(tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    out = tmp_path / "draft.json"
    assert main(["contract", "init", "mixed", "--from", str(corpus), "--out", str(out)]) == 0, capsys.readouterr().err
    suite = json.loads(out.read_text())
    assert contract_problems(suite, name="mixed", version=1) == []
    return suite


def test_init_profiles_string_next_to_large_string(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = _texts(20)
    _shard(tmp_path / "c" / "train" / "part-00000.parquet", docs[:10])
    _shard(tmp_path / "c" / "train" / "part-00001.parquet", docs[10:], pa.large_string())
    suite = _init(tmp_path, tmp_path / "c", capsys)
    assert suite["meta"]["kiln_profile"]["documents"] == 20
    assert {"type": "expect_column_values_to_be_of_type", "kwargs": {"column": "text", "type_": "str"},
            "meta": {"kiln_rule": "schema.types"}, "description": "text is str (observed)."} in suite["expectations"]


def test_init_names_an_empty_shard_and_profiles_the_others(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _shard(tmp_path / "c" / "train" / "part-00000.parquet", [])
    _shard(tmp_path / "c" / "train" / "part-00001.parquet", _texts(8))
    suite = _init(tmp_path, tmp_path / "c", capsys)
    profile = suite["meta"]["kiln_profile"]
    assert profile["shards_empty"] == ["part-00000.parquet"] and profile["documents"] == 8


def test_init_on_only_empty_shards_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _shard(tmp_path / "c" / "train" / "part-00000.parquet", [])
    assert main(["contract", "init", "empty", "--from", str(tmp_path / "c"), "--out", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kiln contract init: error:"), err
    assert "without a row" in err[0] and not (tmp_path / "d.json").exists()

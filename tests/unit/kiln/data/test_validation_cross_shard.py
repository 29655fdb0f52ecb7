"""``kiln.data.validation.cross_shard``: the later shard of a doc-id collision is blamed, in any input order."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kiln.data.validation import CROSS_SHARD_RULE, cross_shard_duplicates, validate_shard

from shard_fixtures import by_path, shard_of


def test_cross_shard_duplicates_blame_the_later_shard_in_any_input_order(poisoned_corpus, poisoned_reports) -> None:
    dup = shard_of(poisoned_corpus, "duplicate_ids_across_shards")
    (reason,) = by_path(poisoned_reports)[dup].reasons
    donor = Path(reason["sample"][0].split("(also in ")[1].rstrip(")")).name
    assert donor < Path(dup).name
    assert by_path(poisoned_reports)[str(Path(dup).with_name(donor))].verdict == "healthy"
    # Order of arrival does not matter: feed the un-crossed reports reversed.
    uncrossed = [dataclasses.replace(r, verdict="healthy", reasons=[]) if r.path == dup else r for r in poisoned_reports]
    again = cross_shard_duplicates(list(reversed(uncrossed)))
    assert [r.path for r in again] == [r.path for r in reversed(uncrossed)]
    assert {r.path: r.verdict for r in again} == {r.path: r.verdict for r in poisoned_reports}


def test_cross_shard_duplicates_ignore_quarantined_shards(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    first = validate_shard(clean_corpus["train"][0], stdlib_contract)
    copy = Path(tmp_path / "shard-99999.parquet")
    copy.write_bytes(Path(first.path).read_bytes())
    second = dataclasses.replace(first, path=str(copy))
    crossed = cross_shard_duplicates([first, second])
    assert [r.verdict for r in crossed] == ["healthy", "quarantined"]
    assert crossed[1].reasons[0]["expectation"] == CROSS_SHARD_RULE
    assert crossed[1].reasons[0]["unexpected_count"] == first.rows
    quarantined_first = dataclasses.replace(first, verdict="quarantined", reasons=[{"expectation": "x"}])
    assert [r.verdict for r in cross_shard_duplicates([quarantined_first, second])] == ["quarantined", "healthy"]

"""``kiln.data.near_duplicates`` and the data gate's near-duplicate pass (``drop_near_duplicates``):
datasketch's MinHash LSH over real prose, deterministic for a snapshot, first copy kept."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kiln.data.contracts import load_contract
from kiln.data.near_duplicates import NearDuplicateIndex, NearDuplicateSettings, shingles, signatures
from kiln.data.validation import NEAR_DUPLICATE_RULE, READABLE_RULE, drop_near_duplicates, drop_rows, validate_shards
from kiln.data.validation.dropped import signature_path
from kiln.errors import ContractError

from webtext_fixtures import prose_documents, write_corpus

SETTINGS = NearDuplicateSettings()


def _edited(text: str, seed: int) -> str:
    words = text.split(" ")
    for i in random.Random(seed).sample(range(len(words)), max(1, len(words) // 100)):
        words[i] = "indeed"
    return " ".join(words)


def _distinct_prose(count: int) -> list[tuple[str, str, str]]:
    """Prose documents no two of which are alike (exact Jaccard of their shingle sets < 0.5, computed
    with Python sets, not MinHash): the licenses share whole paragraphs (GPL-2 / LGPL-2.1, ...)."""
    kept: list[tuple[str, str, str]] = []
    sets: list[set[bytes]] = []
    for doc in prose_documents():
        mine = set(shingles(doc[1], SETTINGS.shingle_words))
        if all(len(mine & other) / len(mine | other) < 0.5 for other in sets):
            kept.append(doc)
            sets.append(mine)
            if len(kept) == count:
                return kept
    raise AssertionError(f"only {len(kept)} distinct prose documents")


@pytest.fixture(scope="module")
def distinct() -> list[tuple[str, str, str]]:
    return _distinct_prose(120)


@pytest.fixture(scope="module")
def texts(distinct) -> list[str]:
    return [t for _, t, _ in distinct[:60]]


def test_signatures_are_a_pure_function_of_text_and_settings(texts) -> None:
    first = signatures(texts[:5], SETTINGS)
    assert first.dtype == np.uint32 and first.shape == (5, SETTINGS.num_perm)
    assert np.array_equal(first, signatures(texts[:5], SETTINGS))
    assert not np.array_equal(first, signatures(texts[:5], replace(SETTINGS, seed=2)))
    assert shingles("The  CAT, sat!", 5) == [b"the cat sat"]  # datatrove's normalisation, fewer words than a shingle
    empty = signatures(["", None, "   "], SETTINGS)
    assert (empty == 0xFFFFFFFF).all()


def test_index_keeps_the_first_copy_and_drops_later_near_copies(texts) -> None:
    index = NearDuplicateIndex(SETTINGS)
    assert index.check_shard(0, signatures(texts[:30], SETTINGS)) == []
    index.accept()
    later = [_edited(texts[3], 1), texts[40], texts[7], _edited(texts[40], 2), ""]
    found = index.check_shard(1, signatures(later, SETTINGS))
    index.accept()
    assert [(d.row, d.of_shard, d.of_row) for d in found] == [(0, 0, 3), (2, 0, 7), (3, 1, 1)]
    assert found[1].similarity == 1.0 and 0.8 <= found[0].similarity < 1.0


def test_a_rejected_shard_leaves_the_index(texts) -> None:
    index = NearDuplicateIndex(SETTINGS)
    index.check_shard(0, signatures(texts[:10], SETTINGS))
    index.reject()
    assert index.documents == 0
    assert index.check_shard(1, signatures(texts[:10], SETTINGS)) == []
    index.accept()
    assert index.documents == 10


def test_skipped_rows_are_neither_checked_nor_kept(texts) -> None:
    index = NearDuplicateIndex(SETTINGS)
    index.check_shard(0, signatures(texts[:3], SETTINGS), skip_rows=frozenset({1}))
    index.accept()
    found = index.check_shard(1, signatures([texts[1], texts[2]], SETTINGS))
    assert [(d.row, d.of_row) for d in found] == [(1, 2)]


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"kind": "datasketch.MinHashLSH", "threshold": 1.5}, "threshold must be a number in"),
        ({"kind": "datasketch.MinHashLSH", "num_perm": 1}, "num_perm must be an int in \\[2, 1024\\]"),
        ({"kind": "datasketch.MinHashLSH", "shingle_words": "5"}, "shingle_words must be an int"),
        ({"kind": "minhash"}, "kind must be 'datasketch.MinHashLSH'"),
        ({"kind": "datasketch.MinHashLSH", "bands": 4}, "bands is not a setting"),
    ],
)
def test_bad_settings_name_their_field(raw, field: str) -> None:
    with pytest.raises(ContractError, match=f"near_duplicates.*{field}"):
        NearDuplicateSettings.from_contract(raw)


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory, distinct):
    """Four shards of prose; shard 2 holds edited copies of shard 0's documents (more than half), shard 3
    an exact copy of one of shard 1's, validated with signatures written as the DAG's tasks do."""
    docs = distinct
    parts = [docs[0:30], docs[30:60], docs[60:90], docs[90:120]]
    parts[2] = [(f"copy-{i}", _edited(t, i), s) for i, (_, t, s) in enumerate(parts[0][:24])] + parts[2][:6]
    parts[3] = [*parts[3][:29], ("exact", parts[1][4][1], "x")]
    root = tmp_path_factory.mktemp("near") / "corpus"
    paths = write_corpus(root, parts)
    contract = load_contract("web-text@1")
    signatures_dir = root.parent / "signatures"
    reports = validate_shards(paths, contract, signatures_dir=signatures_dir)
    return {"paths": paths, "reports": reports, "contract": contract, "signatures": signatures_dir}


def test_gate_drops_near_duplicates_in_path_order_whatever_order_reports_come_in(gated) -> None:
    contract, reports = gated["contract"], gated["reports"]
    assert all(r.verdict == "healthy" for r in reports)
    assert len(list(gated["signatures"].glob("*.minhash.npy"))) == 4
    first = drop_near_duplicates(reports, contract, signatures_dir=gated["signatures"])
    shuffled = list(reversed(reports))
    again = drop_near_duplicates(shuffled, contract, signatures_dir=gated["signatures"])
    assert {r.path: r for r in again} == {r.path: r for r in first}
    without_cache = drop_near_duplicates(reports, contract)
    assert without_cache == first
    by_name = {Path(r.path).name: r for r in first}
    assert NEAR_DUPLICATE_RULE not in (by_name["shard-00000.parquet"].dropped or {}).get("rules", {})
    copies = by_name["shard-00002.parquet"]
    # Each copy of a shard-0 document the rules kept is dropped as its near-duplicate (a copy of a dropped
    # one fails the same document rule itself and never reaches the index).
    kept_originals = [row for row in range(24) if row not in drop_rows(by_name["shard-00000.parquet"])]
    near = [row for row in drop_rows(copies) if row < 24]
    assert copies.verdict == "quarantined" and copies.reasons[-1]["by_rule"][NEAR_DUPLICATE_RULE] == len(kept_originals)
    assert set(kept_originals) <= set(near)
    exact = by_name["shard-00003.parquet"]
    assert exact.verdict == "healthy" and 29 in drop_rows(exact)
    assert exact.dropped["rules"][NEAR_DUPLICATE_RULE]["sample"][-1].startswith("exact ≈ ")


def test_a_shard_whose_bytes_changed_since_validation_is_quarantined_at_the_gate(gated, tmp_path: Path) -> None:
    report = gated["reports"][1]
    moved = tmp_path / "shard.parquet"
    moved.write_bytes(Path(report.path).read_bytes()[:-10])
    changed = replace(report, path=str(moved))
    [after] = drop_near_duplicates([changed], gated["contract"])
    assert after.verdict == "quarantined" and after.reasons[-1]["expectation"] == READABLE_RULE
    assert "changed since it was validated" in after.reasons[-1]["error"]


def test_a_signature_file_of_the_wrong_shape_is_recomputed(gated, tmp_path: Path) -> None:
    contract = gated["contract"]
    settings = NearDuplicateSettings.from_contract(contract.near_duplicates)
    cache = tmp_path / "sig"
    cache.mkdir()
    for report in gated["reports"]:
        np.save(signature_path(cache, report.sha256, settings), np.zeros((3, 2), dtype=np.uint32))
    assert drop_near_duplicates(gated["reports"], contract, signatures_dir=cache) == drop_near_duplicates(
        gated["reports"], contract, signatures_dir=gated["signatures"])


def test_signatures_are_datasketch_minhash_of_datatrove_shingles_bit_for_bit() -> None:
    """The batched hashing (``_sha1_hash32`` handed to ``update_batch``) and the ASCII shortcut of the
    normalisation give exactly what datasketch's own per-shingle SHA-1 gives over the shingle set built
    the plain way (datatrove's ``simplify_text``, one ``join`` and ``encode`` per shingle)."""
    from datasketch import MinHash
    from datatrove.utils.text import simplify_text

    from kiln.data.near_duplicates import MINHASH_SCHEME
    from kiln.data.poison_text import TEXT_POISON_KINDS

    from webtext_fixtures import poisoned

    docs = prose_documents()
    texts = [t for _, t, _ in docs[:300]]
    for kind in TEXT_POISON_KINDS:
        texts += [t for _, t, _ in poisoned(kind, docs[:40], donors=docs[40:80])]
    texts += ["ÉCOLE café naïve “quoted” — dash, Ünïcödé ﬁ ligature 東京 text here", "a b", "one two three four five",
              "Ça va? Oui! Très bien. Merci beaucoup, à demain et après-demain aussi."]
    for settings in (SETTINGS, replace(SETTINGS, shingle_words=3, num_perm=64, seed=7)):
        want = np.full((len(texts), settings.num_perm), 0xFFFFFFFF, dtype=np.uint32)
        for row, text in enumerate(texts):
            tokens = simplify_text(text).split()
            if len(tokens) <= settings.shingle_words:
                parts = {" ".join(tokens).encode()} if tokens else set()
            else:
                w = settings.shingle_words
                parts = {" ".join(tokens[i : i + w]).encode() for i in range(len(tokens) - w + 1)}
            if parts:
                minhash = MinHash(num_perm=settings.num_perm, seed=settings.seed, scheme=MINHASH_SCHEME)
                minhash.update_batch(sorted(parts))
                want[row] = minhash.hashvalues
        assert np.array_equal(signatures(texts, settings), want)


def test_a_near_copy_of_an_eval_document_is_dropped_from_training(distinct, tmp_path: Path) -> None:
    """The exact-hash contamination rule misses an edited copy of a held-out document: the gate's
    near-duplicate pass indexes the eval split first and drops the training copy (detail eval_split);
    the eval documents themselves are never touched."""
    from kiln.data.corpus import parquet_bytes
    from kiln.data.validation import validate_directory
    from kiln.data.validation.dropped import EVAL_SPLIT_DETAIL

    from webtext_fixtures import table

    root = tmp_path / "corpus"
    write_corpus(root, [distinct[0:30], distinct[30:60]])
    (root / "eval").mkdir()
    held_out = [("held-out-1", _edited(distinct[35][1], 7), "x"), distinct[100]]
    (root / "eval" / "eval-00000.parquet").write_bytes(parquet_bytes(table(held_out)))
    contract = load_contract("web-text@1")
    reports = validate_shards(sorted((root / "train").glob("*.parquet")), contract)

    without = {Path(r.path).name: r for r in drop_near_duplicates(reports, contract)}
    assert 5 not in drop_rows(without["shard-00001.parquet"])
    gated = {Path(r.path).name: r for r in drop_near_duplicates(reports, contract, eval_split=root)}
    shard = gated["shard-00001.parquet"]
    assert shard.verdict == "healthy" and 5 in drop_rows(shard)
    near = shard.dropped["rules"][NEAR_DUPLICATE_RULE]
    assert near["details"] == {EVAL_SPLIT_DETAIL: 1}
    assert len(near["sample"]) == 1
    assert near["sample"][0].startswith(f"{distinct[35][0]} ≈ held-out-1 in the eval split's eval-00000.parquet (Jaccard ≈ ")
    assert gated["shard-00000.parquet"] == without["shard-00000.parquet"]  # nothing else changes
    assert {Path(r.path).name: r for r in validate_directory(root, contract)} == gated  # kiln validate DIR too

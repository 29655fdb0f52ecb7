"""``kiln.stages.snapshot_stage``: the production corpus policy and the asset-announced id check."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import settings as kiln_settings
from kiln.data import snapshot
from kiln.errors import ConfigError, SnapshotError
from kiln.policy import PRODUCTION, SANDBOX
from kiln.stages import snapshot_stage


def _corpus(name: str, tag: bytes = b"") -> Path:
    root = kiln_settings.load().corpus_root / name
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "eval").mkdir(exist_ok=True)
    for i in range(2):
        (root / "train" / f"shard-{i:05d}.parquet").write_bytes(b"%d %s" % (i, tag) * 500)
    (root / "eval" / "eval-00000.parquet").write_bytes(b"eval")
    return root


def test_production_refuses_a_corpus_that_is_not_registered(home):
    _corpus("scratch-corpus")
    with pytest.raises(ConfigError,
                       match=r"production runs snapshot only the registered corpus 'stdlib-py', not 'scratch-corpus'"):
        snapshot_stage(PRODUCTION, "scratch-corpus")
    assert not (kiln_settings.load().dvc_repo / ".kiln-snapshots").exists(), "something was snapshotted"


def test_sandbox_may_snapshot_another_corpus(home):
    _corpus("scratch-corpus")
    assert snapshot_stage(SANDBOX, "scratch-corpus").corpus == "scratch-corpus"


def test_announced_snapshot_id_that_differs_from_the_bytes_found_fails(home):
    corpus = _corpus(PRODUCTION.corpus)
    announced = snapshot.create_snapshot(corpus).id
    (corpus / "train" / "shard-00001.parquet").write_bytes(b"rebuilt after the announcement")
    with pytest.raises(SnapshotError,
                       match=rf"triggered for corpus snapshot\(s\) {announced} .*refusing to train on other bytes"):
        snapshot_stage(PRODUCTION, None, [announced])
    assert not (kiln_settings.load().home / "snapshots").exists(), "the run pinned bytes it must not train on"


def test_announced_id_mismatch_is_not_retried(home):
    corpus = _corpus(PRODUCTION.corpus)
    announced = snapshot.create_snapshot(corpus).id
    (corpus / "train" / "shard-00001.parquet").write_bytes(b"rebuilt after the announcement")
    with pytest.raises(SnapshotError) as info:
        snapshot_stage(PRODUCTION, None, [announced])
    assert info.value.retryable is False


def test_matching_announced_id_passes_and_pins_those_bytes(home):
    corpus = _corpus(PRODUCTION.corpus)
    announced = snapshot.create_snapshot(corpus).id
    result = snapshot_stage(PRODUCTION, None, ["0" * 32 + ".dir", announced])  # coalesced events: any one
    assert result.id == announced
    assert result.shards == ["train/shard-00000.parquet", "train/shard-00001.parquet"]
    pinned = Path(result.path)
    assert pinned == kiln_settings.load().home / "snapshots" / announced.removesuffix(".dir")
    assert (pinned / "train" / "shard-00000.parquet").read_bytes() == (corpus / "train" / "shard-00000.parquet").read_bytes()


def test_the_dag_lists_the_shards_validate_lists_and_names_the_rest(home):
    """The DAG's shard plan is ``train/*.parquet``, as ``kiln validate`` sees it: a stray file is
    named as skipped (never quarantined as unreadable Parquet) and a subfolder is named too (never
    dropped in silence)."""
    corpus = _corpus("scratch-corpus")
    (corpus / "train" / "NOTES.txt").write_text("not a shard")
    (corpus / "train" / "extra").mkdir()
    (corpus / "train" / "extra" / "shard-00009.parquet").write_bytes(b"nested")
    result = snapshot_stage(SANDBOX, "scratch-corpus")
    assert result.shards == ["train/shard-00000.parquet", "train/shard-00001.parquet"]
    skipped = {Path(e["path"]).name: e["reason"] for e in result.skipped}
    assert set(skipped) == {"NOTES.txt", "extra"} and all(skipped.values())
    assert all(Path(e["path"]).is_relative_to(result.path) for e in result.skipped)


# ---------------------------------------------------------------- the contract a run validates with


def _imported(name: str, contract: str = "stdlib-py@1", kind: str = "python-source") -> Path:
    """A corpus as `kiln corpus import` writes it, whose corpus.json names ``contract``."""
    from kiln.data.corpora import CorpusMetadata, SplitStats, write_metadata

    root = _corpus(name)
    stats = SplitStats(shards=2, documents=2, text_bytes=2)
    write_metadata(root, CorpusMetadata(kind=kind, contract=contract, producer="test", source={}, split={},
                                        train=stats, eval=stats))
    return root


def test_a_run_validates_with_the_contract_its_corpus_names_unless_it_asks_for_one_that_fits(home):
    from kiln.errors import ContractError
    from kiln.stages import run_policy

    _imported("mine")
    pinned = snapshot_stage(SANDBOX, "mine")
    assert run_policy(SANDBOX, {}, pinned).contract == "stdlib-py@1"
    assert run_policy(SANDBOX, {"contract": "stdlib-py@1"}, pinned).contract == "stdlib-py@1"
    _imported("prose", contract="other-text@1", kind="natural-language")
    prose = snapshot_stage(SANDBOX, "prose")
    with pytest.raises(ContractError, match="unknown contract 'other-text'"):
        run_policy(SANDBOX, {}, prose)  # the corpus' own contract, which this kiln does not ship
    with pytest.raises(ConfigError, match="contract 'stdlib-py@1' does not fit corpus 'prose'"):
        run_policy(SANDBOX, {"contract": "stdlib-py@1"}, prose)


def test_production_validates_its_reviewed_corpus_with_its_reviewed_contract_only(home):
    from kiln.stages import run_policy

    _imported(PRODUCTION.corpus)
    pinned = snapshot_stage(PRODUCTION, None)
    assert run_policy(PRODUCTION, {}, pinned) is PRODUCTION
    _imported(PRODUCTION.corpus, contract="other-text@1", kind="natural-language")  # rebuilt for another family
    with pytest.raises(ConfigError, match=f"contract '{PRODUCTION.contract}' does not fit corpus '{PRODUCTION.corpus}'"):
        run_policy(PRODUCTION, {}, snapshot_stage(PRODUCTION, None))

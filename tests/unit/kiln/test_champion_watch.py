"""The champion watch's decision (pure) and the rollback's refusals that need no server."""

from __future__ import annotations

import dataclasses

import pytest

from kiln.errors import ConfigError, PolicyError
from kiln.policy import PRODUCTION
from kiln.refs import ApprovalAnswer, ChampionEvaluation, PinnedSnapshot, VersionEvaluation
from kiln.stages.champion_watch import rollback_review_stage, rollback_stage, watch_decision


def _version(version: str, now: float, recorded: float) -> VersionEvaluation:
    return VersionEvaluation(version=version, current_bits_per_byte=now, recorded_bits_per_byte=recorded,
                             recorded_snapshot_id="r.dir", current_tokens=100, checkpoint=f"/ckpt/v{version}")


def evaluation(now: float, recorded: float, previous_now: float | None = None) -> ChampionEvaluation:
    return ChampionEvaluation(model="m", alias="champion", snapshot_id="s.dir", champion=_version("2", now, recorded),
                              previous=None if previous_now is None else _version("1", previous_now, 4.0))


def test_within_tolerance_is_ok_even_if_previous_is_slightly_better():
    d = watch_decision(evaluation(3.04, 3.0, previous_now=3.0), tolerance=0.05)
    assert d.action == "ok" and d.champion_version == "2"


def test_regression_against_the_record_proposes_a_rollback_to_a_better_previous():
    d = watch_decision(evaluation(5.2, 2.4, previous_now=4.1), tolerance=0.05)
    assert d.action == "propose_rollback" and d.previous_version == "1"
    assert d.champion_current_bits_per_byte == 5.2 and d.champion_recorded_bits_per_byte == 2.4
    assert "REGRESSED" in d.reasons[0] and "v1" in d.reasons[-1]


def test_falling_behind_previous_on_todays_split_is_a_regression_too():
    d = watch_decision(evaluation(3.0, 3.0, previous_now=2.8), tolerance=0.05)
    assert d.action == "propose_rollback"


def test_regression_without_a_better_version_is_not_a_rollback():
    assert watch_decision(evaluation(5.0, 3.0), tolerance=0.05).action == "regressed_no_fallback"
    assert watch_decision(evaluation(5.0, 3.0, previous_now=5.5), tolerance=0.05).action == "regressed_no_fallback"


def test_non_finite_current_loss_is_a_regression():
    assert watch_decision(evaluation(float("nan"), 3.0, previous_now=4.0), tolerance=0.05).action == "propose_rollback"


def test_nothing_serving_is_nothing_to_watch():
    d = watch_decision(ChampionEvaluation(model="m", alias="champion", champion=None, previous=None), tolerance=0.05)
    assert d.action == "no_champion"


@pytest.mark.parametrize("tolerance", [-0.1, float("inf")])
def test_bad_tolerance_is_refused(tolerance):
    with pytest.raises(ConfigError, match="tolerance"):
        watch_decision(evaluation(3.0, 3.0), tolerance=tolerance)


def test_rollback_refuses_without_a_proposal_or_a_named_approval(monkeypatch):
    from kiln import registry

    def no_client():
        raise AssertionError("an MLflow client was created: a request would have been sent")

    monkeypatch.setattr(registry.mlflow_io, "_client", no_client)
    proposal = watch_decision(evaluation(5.2, 2.4, previous_now=4.1), tolerance=0.05)
    with pytest.raises(PolicyError, match="nothing to roll back"):
        rollback_stage(PRODUCTION, dataclasses.replace(proposal, action="ok"), "d/r")
    with pytest.raises(PolicyError, match="nothing was proposed"):
        rollback_review_stage(PRODUCTION, dataclasses.replace(proposal, action="ok"),
                              ApprovalAnswer(chosen_options=["Approve"]), "d/r")
    # An Approve is recorded only from a named reviewer of the policy (the rollback reads it back).
    with pytest.raises(PolicyError, match="'unknown' answered Approve, but is not one of"):
        rollback_review_stage(PRODUCTION, proposal, ApprovalAnswer(chosen_options=["Approve"], responded_by_user={},
                                                                   responded_at="2026-12-01T12:00:00+00:00"), "d/r")
    with pytest.raises(PolicyError, match="'r' answered Approve, but is not one of"):
        rollback_review_stage(PRODUCTION, proposal, ApprovalAnswer(chosen_options=["Approve"],
                                                                   responded_by_user={"name": "r"},
                                                                   responded_at="2026-12-01T12:00:00+00:00"), "d/r")


def test_heldout_manifest_lists_the_eval_split_and_only_readable_training_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kiln.refs import TrainingManifest
    from kiln.stages.champion_watch import heldout_manifest

    for sub in ("train", "eval"):
        (tmp_path / sub).mkdir()
    table = pa.table({"doc_id": ["a", "b"], "text": ["x = 1\n" * 20, "y = 2\n" * 20], "source": ["s", "s"]})
    pq.write_table(table, tmp_path / "train" / "shard-0.parquet")
    (tmp_path / "train" / "shard-1.parquet").write_bytes(b"PAR1 not parquet")  # the gate would quarantine it
    pq.write_table(table, tmp_path / "eval" / "eval-0.parquet")
    snapshot = PinnedSnapshot(id="abc.dir", corpus="c", files=3, bytes=1, dvc="", remote="", path=str(tmp_path),
                              shards=["train/shard-0.parquet", "train/shard-1.parquet"])
    # Signed like any TrainingManifest; the evaluator's reader also wants a non-empty shard list.
    manifest = TrainingManifest.read(heldout_manifest(snapshot, PRODUCTION, tmp_path))
    assert [s["path"] for s in manifest.shards] == [str(tmp_path / "train" / "shard-0.parquet")]
    assert [s["path"] for s in manifest.eval_shards] == [str(tmp_path / "eval" / "eval-0.parquet")]
    (tmp_path / "eval" / "eval-0.parquet").unlink()
    with pytest.raises(ConfigError, match="no readable held-out split"):
        heldout_manifest(snapshot, PRODUCTION, tmp_path)

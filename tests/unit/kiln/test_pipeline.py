"""Pipeline stages that need no services: batching and the data gate's completeness check."""

from __future__ import annotations

import dataclasses

import pytest

from kiln import pipeline
from kiln.errors import DataGateError
from kiln.policy import SANDBOX


def test_shard_batches_cover_every_shard_once_in_order():
    snap = {"shards": [f"train/shard-{i:05d}.parquet" for i in range(10)]}
    batches = pipeline.shard_batches(dataclasses.replace(SANDBOX, validation_batch_shards=4), snap)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [s for b in batches for s in b] == snap["shards"]


def test_data_gate_refuses_a_snapshot_with_unvalidated_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    snap = {"id": "0" * 32 + ".dir", "corpus": "c", "path": str(tmp_path / "snap"),
            "shards": ["train/a.parquet", "train/b.parquet"]}
    only_a = [[{"path": str(tmp_path / "snap" / "train" / "a.parquet"), "sha256": "x", "rows": 1,
                "verdict": "healthy", "reasons": [], "contract": "stdlib-py@1"}]]
    with pytest.raises(DataGateError, match="never validated.*b.parquet"):
        pipeline.data_gate_stage(SANDBOX, snap, only_a, "kiln_sandbox/manual__1")
    assert not (tmp_path / "runs" / "kiln_sandbox" / "manual__1" / "training-manifest.json").exists()


def test_run_dir_is_keyed_by_dag_and_run(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    d = pipeline.run_dir(pipeline.run_key("kiln_production", "scheduled__2026-11-30T03:00:00+00:00"))
    assert d.parent.name == "kiln_production" and ":" not in d.name and "+" not in d.name


def test_an_unreadable_job_record_is_named_and_nothing_is_cancelled(tmp_path, monkeypatch):
    from kiln.errors import LaunchError

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    key = pipeline.run_key("kiln_sandbox", "manual__1")
    assert pipeline.cancel_live_job(key) is None  # nothing submitted
    record = pipeline.run_dir(key) / "train" / ".launch" / pipeline.JOB_RECORD
    record.parent.mkdir(parents=True)
    for torn in ('{"backend": "slurm", ', '{"backend": "slurm", "options": {}}', '["slurm"]'):
        record.write_text(torn)  # cut short, a key missing, not an object
        with pytest.raises(LaunchError, match=str(record)):
            pipeline.cancel_live_job(key)


def test_outcome_says_why_nothing_was_promoted(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    candidate = {"model_name": "sandbox.kiln-stdlib-lm", "version": "3",
                 "decision": {"action": "hold", "reasons": ["threshold: FAILED 9.1 > 8.0"],
                              "candidate_bits_per_byte": 9.1}}
    out = pipeline.outcome_stage(SANDBOX, candidate, None, None, "kiln_sandbox/manual__2")
    assert out["promoted"] is False and "hold" in out["message"] and "9.1 > 8.0" in out["message"]
    assert (tmp_path / "runs" / "kiln_sandbox" / "manual__2" / "summary.json").is_file()


def test_unknown_run_parameters_are_refused_by_name():
    from kiln.errors import ConfigError
    from kiln.policy import PRODUCTION

    pipeline.check_run_conf(PRODUCTION, {"reason": "weekly"}, {"reason"})
    with pytest.raises(ConfigError, match="recipe"):
        pipeline.check_run_conf(PRODUCTION, {"reason": "x", "recipe": "tiny.toml"}, {"reason"})


def test_batches_grow_so_a_huge_corpus_stays_under_max_map_length():
    snap = {"shards": [f"train/shard-{i:06d}.parquet" for i in range(100_000)]}
    batches = pipeline.shard_batches(SANDBOX, snap)
    assert len(batches) <= SANDBOX.validation_max_tasks < 1024
    assert sum(len(b) for b in batches) == 100_000


def test_outcome_of_a_timed_out_review_names_no_reviewer(tmp_path, monkeypatch):
    from kiln import registry
    from kiln.policy import PRODUCTION

    recorded = {}
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    monkeypatch.setattr(registry, "record_review", lambda **kw: recorded.update(kw))
    candidate = {"model_name": PRODUCTION.candidate_model, "version": "4",
                 "decision": {"action": "promote", "reasons": ["threshold: ok"], "candidate_bits_per_byte": 3.1}}
    review = {"chosen_options": ["Reject"], "responded_by_user": {}, "timed_out": True, "responded_at": "2026-11-30T03:00:00"}
    out = pipeline.outcome_stage(PRODUCTION, candidate, review, None, "kiln_production/scheduled__x")
    assert out["promoted"] is False and out["review"] == "timed out" and "timed out" in out["message"]
    assert recorded["outcome"] == "timed out" and recorded["candidate_version"] == "4"

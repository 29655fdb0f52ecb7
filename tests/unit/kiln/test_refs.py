"""``kiln.refs``: every ref survives the trip through JSON (an XCom) unchanged, says on the wire exactly
the keys its docstring documents (the XCom keys the DAG's templates, links and e2e tests read), and a
malformed one is a ``ManifestError`` naming the ref."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kiln.errors import ManifestError
from kiln.refs import (
    ApprovalAnswer,
    ChampionEvaluation,
    DataGateResult,
    Decision,
    JobEnded,
    PinnedSnapshot,
    PromotionRecord,
    QuarantinedShard,
    Ref,
    RegisteredCandidate,
    RollbackRecord,
    RunOutcome,
    StragglerWatchPlan,
    TrainingManifest,
    TrainResult,
    VersionEvaluation,
    WatchDecision,
    WatchOutcome,
)

SNAPSHOT = PinnedSnapshot(id="a" * 32 + ".dir", corpus="stdlib-py", files=3, bytes=30, dvc="outs: []\n",
                          remote="/remote", path="/snapshots/a", shards=["train/shard-00000.parquet"],
                          skipped=[{"path": "/snapshots/a/train/NOTES.txt", "reason": "not *.parquet"}])
DATA = DataGateResult(manifest="/runs/r/training-manifest.json", manifest_sha256="b" * 64, healthy=6,
                      quarantined=[QuarantinedShard(path="shard-00002.parquet", reasons=["no_secrets (3 rows)"])],
                      quarantine_rate=0.25, report="/runs/r/quarantine-report.json",
                      report_html="/runs/r/quarantine-report.html", report_html_uri="runs:/m/quarantine/q.html",
                      mlflow_run_id="m", contract="stdlib-py@1")
DECISION = Decision(action="promote", reasons=["threshold: ok"], candidate_bits_per_byte=3.1, champion_bits_per_byte=3.3)
CANDIDATE = RegisteredCandidate(model_name="kiln-stdlib-lm.candidates", version="4", run_id="m",
                                model_uri="models:/kiln-stdlib-lm.candidates/4", source="runs:/m/model", decision=DECISION,
                                created=True, report_uri="runs:/m/report/report.html", ui_url="http://mlflow/#/models/x")
PROMOTION = PromotionRecord(registered_model="kiln-stdlib-lm", version="2", alias="champion", approver="reviewer",
                            at="2026-12-01T12:00:00+00:00", previous_version="1")
CHAMPION = VersionEvaluation(version="2", recorded_bits_per_byte=2.4, recorded_snapshot_id="s.dir",
                             current_bits_per_byte=5.2, current_tokens=100, checkpoint="/ckpt/step-00000030")
EVALUATION = ChampionEvaluation(model="kiln-stdlib-lm", alias="champion", champion=CHAMPION,
                                previous=VersionEvaluation(version="1", recorded_bits_per_byte=4.0,
                                                           recorded_snapshot_id="s.dir", current_bits_per_byte=4.1,
                                                           current_tokens=100, checkpoint="/ckpt/step-00000020"),
                                snapshot_id="t.dir")
PROPOSAL = WatchDecision(model="kiln-stdlib-lm", alias="champion", tolerance=0.05, snapshot_id="t.dir",
                         champion_version="2", previous_version="1", action="propose_rollback", reasons=["REGRESSED"],
                         champion_current_bits_per_byte=5.2, champion_recorded_bits_per_byte=2.4,
                         previous_current_bits_per_byte=4.1)

EVERY_NEW_REF: list[Ref] = [
    SNAPSHOT, DATA, CANDIDATE,
    StragglerWatchPlan(action="exclude_node", offset=120, excluded=["node2"]),
    JobEnded(state="FAILED", reason="rank 1 exited 1", log_tail="Traceback ..."),
    ApprovalAnswer(chosen_options=["Approve"], responded_by_user={"id": "7", "name": "reviewer"},
                   responded_at="2026-12-01T12:00:00+00:00"),
    RunOutcome(candidate_model=CANDIDATE.model_name, candidate_version="4", decision="promote",
               decision_reasons=["threshold: ok"], promoted=True, message="promoted", review="approved",
               reviewer="reviewer", reviewed_at="2026-12-01T12:00:00+00:00", review_comment="", model="kiln-stdlib-lm",
               version="2", alias="champion", approver="reviewer"),
    EVALUATION, PROPOSAL,
    RollbackRecord(**PROMOTION.to_json(), reason="champion watch d/r: v2 regressed"),
    WatchOutcome(decision="ok", reasons=["ok: champion v2 holds up"], model="kiln-stdlib-lm", rolled_back=False,
                 message="champion v2 holds up"),
]


@pytest.mark.parametrize("ref", EVERY_NEW_REF, ids=lambda ref: type(ref).__name__)
def test_a_ref_comes_back_from_its_json_unchanged(ref: Ref):
    wire = json.loads(json.dumps(ref.to_json()))
    assert type(ref).from_json(wire) == ref


def test_the_stage_refs_say_the_keys_the_xcoms_always_had():
    assert set(SNAPSHOT.to_json()) == {"id", "corpus", "files", "bytes", "dvc", "remote", "path", "shards", "skipped"}
    assert set(DATA.to_json()) == {"manifest", "manifest_sha256", "healthy", "quarantined", "quarantine_rate", "report",
                                   "report_html", "report_html_uri", "mlflow_run_id", "contract"}
    assert DATA.to_json()["quarantined"] == [{"path": "shard-00002.parquet", "reasons": ["no_secrets (3 rows)"]}]
    assert set(CANDIDATE.to_json()) == {"model_name", "version", "run_id", "model_uri", "source", "decision", "created",
                                        "report_uri", "ui_url"}
    assert CANDIDATE.to_json()["decision"] == DECISION.to_json()
    assert StragglerWatchPlan(action="alert").to_json() == {"action": "alert", "offset": 0, "excluded": []}
    assert set(RollbackRecord(**PROMOTION.to_json(), reason="why").to_json()) == {*PROMOTION.to_json(), "reason"}


def test_facts_a_ref_has_only_sometimes_are_absent_from_the_wire_not_null():
    held = RunOutcome(candidate_model="m", candidate_version="3", decision="hold", decision_reasons=["FAILED"],
                      promoted=False, message="NOT promoted: the model gate said hold: FAILED")
    assert set(held.to_json()) == {"candidate_model", "candidate_version", "decision", "decision_reasons", "promoted",
                                   "message"}
    assert RunOutcome.from_json(held.to_json()) == held
    assert set(ApprovalAnswer().to_json()) == {"chosen_options", "responded_by_user", "timed_out", "responded_at"}
    nobody = ChampionEvaluation(model="m", alias="champion")
    assert nobody.to_json() == {"model": "m", "alias": "champion", "champion": None, "previous": None}
    no_champion = WatchDecision(model="m", alias="champion", tolerance=0.05, snapshot_id=None, champion_version=None,
                                previous_version=None, action="no_champion", reasons=["nobody holds champion"])
    assert set(no_champion.to_json()) == {"model", "alias", "tolerance", "snapshot_id", "champion_version",
                                          "previous_version", "action", "reasons"}
    assert WatchDecision.from_json(no_champion.to_json()) == no_champion
    alone = WatchDecision(**{**PROPOSAL.to_json(), "previous_version": None, "previous_current_bits_per_byte": None,
                             "action": "regressed_no_fallback"})
    assert alone.to_json()["previous_current_bits_per_byte"] is None, "with a champion, every number is on the wire"


def test_a_trigger_event_is_read_for_how_the_job_ended_only():
    event = {"state": "FATAL", "reason": "rank 0 exited 2", "log_tail": "...", "node": "node2",
             "handle": {"backend": "slurm", "job_id": "7", "run_dir": "/runs/r/train"}}
    assert JobEnded.from_json(event) == JobEnded(state="FATAL", reason="rank 0 exited 2", log_tail="...")


@pytest.mark.parametrize(("ref", "wire", "message"), [
    (DataGateResult, ["not", "an", "object"], "DataGateResult: expected a JSON object, got list"),
    (RegisteredCandidate, {"model_name": "m", "version": "4"}, "RegisteredCandidate: .*'decision'"),
    (RegisteredCandidate, {**CANDIDATE.to_json(), "decision": "promote"}, "RegisteredCandidate.decision: expected a "
                                                                           "Decision"),
    (RegisteredCandidate, {**CANDIDATE.to_json(), "decision": {"action": "promote"}}, "Decision: .*'reasons'"),
    (DataGateResult, {**DATA.to_json(), "quarantined": [{"path": "x"}]}, "QuarantinedShard: .*'reasons'"),
    (ChampionEvaluation, {**EVALUATION.to_json(), "champion": 5.2}, "ChampionEvaluation.champion: expected"),
])
def test_a_malformed_xcom_is_refused_naming_the_ref(ref: type[Ref], wire, message: str):
    with pytest.raises(ManifestError, match=message) as info:
        ref.from_json(wire)
    assert info.value.retryable is False


def test_a_shard_reports_xcom_carries_its_dropped_rows_as_a_digest_of_fixed_size():
    """A validate_shards XCom stays small however many documents a shard drops: the rows become a
    count and a sha256 (the run's validation record keeps the list), and any change to them changes
    the digest, so the data gate's comparison with the record still catches a rewritten XCom."""
    from kiln.refs import ShardReport

    def report(rows: list[int]) -> ShardReport:
        return ShardReport(path="/c/train/shard-00000.parquet", sha256="ab" * 32, rows=100_000, verdict="healthy",
                           contract="web-text@1",
                           dropped={"rows": rows, "share": len(rows) / 100_000,
                                    "rules": {"pii": {"count": len(rows), "details": {"email": len(rows)}, "sample": ["d1"]}}})

    many = report(list(range(0, 100_000, 2)))
    xcom = many.as_xcom()
    assert "rows" not in xcom.dropped and xcom.dropped["rows_count"] == 50_000
    assert {k: v for k, v in xcom.dropped.items() if not k.startswith("rows_")} == {
        k: v for k, v in many.dropped.items() if k != "rows"}, "share, rules and samples as they were"
    assert len(json.dumps(xcom.to_json())) < 1_000 < len(json.dumps(many.to_json()))
    assert xcom.as_xcom() == xcom, "idempotent: a report already in its XCom form stays as it is"
    assert ShardReport.from_json(json.loads(json.dumps(xcom.to_json()))) == xcom
    assert report(list(range(1, 100_000, 2))).as_xcom() != xcom, "other rows, another digest"
    empty = report([]).as_xcom().dropped
    assert empty["rows_count"] == 0 and empty["rows_sha256"] not in (xcom.dropped["rows_sha256"], "")
    plain = ShardReport(path="/c/train/shard-00001.parquet", sha256="cd" * 32, rows=3, verdict="healthy")
    assert plain.as_xcom() is plain, "a contract that drops nothing: the report as it always was"


# ------------------------------------------------------------------ the trainer contract, both sides
def _fixed_manifest() -> TrainingManifest:
    return TrainingManifest.build(
        snapshot_id="0123456789abcdef0123456789abcdef.dir", corpus="web-ü", contract="web@1",
        shards=[{"path": "/data/train/part-0.parquet", "sha256": "a" * 64, "rows": 10},
                {"path": "/data/train/part-1.parquet", "sha256": "b" * 64, "rows": 4, "drop_rows": [0, 3]}],
        eval_shards=[{"path": "/data/eval/part-0.parquet", "sha256": "c" * 64, "rows": 2}],
        quarantined=["/data/train/bad.parquet"])


def test_kilns_training_manifest_keeps_the_hash_it_had_before_the_contract():
    """Literals computed by this writer before the hash rule moved to ``kiln_trainer.contract``."""
    manifest = _fixed_manifest()
    assert manifest.sha256 == "d650c8182129809f19460721bbacfadeada6ee531b5e03aa90955cce286ab47c"
    tokens = manifest.with_tokens("/data/tokens/token_manifest.json", "d" * 64)
    assert tokens.sha256 == "d2d277bafdda9e5a80304634a17c2d069ef26d53904e91b7c3c075c1fc2fccc5"


def test_a_manifest_kiln_writes_verifies_in_the_trainers_reader(tmp_path: Path):
    from kiln_trainer.contract.training_manifest import load_training_manifest

    for manifest in (_fixed_manifest(), _fixed_manifest().with_tokens("s3://b/tokens/token_manifest.json", "d" * 64)):
        read = load_training_manifest(manifest.write(tmp_path / "m.json"))
        assert read.sha256 == manifest.sha256
        assert [s.drop_rows for s in read.shards] == [(), (0, 3)]


def test_a_manifest_names_its_trainer_under_a_new_hash_and_older_ones_keep_theirs(tmp_path: Path):
    from kiln_trainer.contract import TrainingManifestError
    from kiln_trainer.contract.training_manifest import load_training_manifest

    plain = _fixed_manifest()
    record = {"spec": "my_lm.train:main", "distribution": "my-lm", "version": "1.0"}
    named = plain.with_trainer(record).with_tokens("/data/tokens/token_manifest.json", "d" * 64)
    assert plain.with_trainer(None).sha256 == plain.sha256 == "d650c8182129809f19460721bbacfadeada6ee531b5e03aa90955cce286ab47c"
    assert named.sha256 not in (plain.sha256, plain.with_tokens("/data/tokens/token_manifest.json", "d" * 64).sha256)
    read = load_training_manifest(named.write(tmp_path / "m.json"))
    assert (read.trainer, read.sha256) == (record, named.sha256)
    assert TrainingManifest.read(tmp_path / "m.json") == named
    assert load_training_manifest(plain.write(tmp_path / "old.json")).trainer is None  # issued before: readable
    wire = {**named.to_json(), "trainer": {"spec": "my_lm.train:main"}}
    wire["sha256"] = TrainingManifest.from_json(wire).content_hash()
    (tmp_path / "bad.json").write_text(json.dumps(wire))
    with pytest.raises(TrainingManifestError, match="'trainer' must be an object of strings"):
        load_training_manifest(tmp_path / "bad.json")


def test_a_manifest_written_by_the_contracts_rule_verifies_in_kilns_reader(tmp_path: Path):
    from kiln_trainer.contract import TRAINING_MANIFEST_KIND, atomic_write_bytes, training_manifest_sha256

    body = {"snapshot_id": "s.dir", "corpus": "c", "contract": "c@1", "eval_shards": [], "quarantined": [],
            "shards": [{"path": "/x/train/a.parquet", "sha256": "e" * 64, "rows": 1}],
            "tokens": {"manifest": "/x/tokens/token_manifest.json", "sha256": "f" * 64}}
    wire = {"kind": TRAINING_MANIFEST_KIND, **body, "sha256": training_manifest_sha256(body)}
    path = atomic_write_bytes(tmp_path / "m.json", json.dumps(wire).encode())
    assert TrainingManifest.read(path).sha256 == wire["sha256"]
    atomic_write_bytes(path, json.dumps({**wire, "corpus": "edited"}).encode())
    with pytest.raises(ManifestError, match="content hash does not match"):
        TrainingManifest.read(path)


def test_every_fact_kilns_train_result_reads_is_in_the_contracts_result_record(tmp_path: Path):
    from kiln.launchers.base import read_result
    from kiln_trainer.contract import RESULT_FILE, TRAIN_RESULT_KIND, TrainResultRecord

    assert {f.name for f in dataclasses.fields(TrainResult)} <= set(TrainResultRecord.__annotations__)
    record: TrainResultRecord = {
        "kind": TRAIN_RESULT_KIND, "run_dir": str(tmp_path), "checkpoint": str(tmp_path / "checkpoints/step-00000002"),
        "checkpoint_manifest_sha256": "1" * 64, "weights_sha256": "2" * 64, "step": 2, "total_steps": 2,
        "completed": True, "recipe_sha256": "3" * 64, "training_manifest_sha256": "4" * 64,
        "token_manifest_sha256": "5" * 64, "tokenizer_sha256": "6" * 64, "snapshot_id": "s.dir", "world_size": 2,
        "metrics": {"final_loss": None, "tokens_per_s": 1.0, "steps": 2, "wall_s": 1.0, "train_tokens": 8,
                    "checkpoint_blocking_s": 0.0},
        "events": [{"kind": "rollback", "at_step": 1}], "mlflow_run_id": "m"}
    (tmp_path / RESULT_FILE).write_text(json.dumps(record))
    result = read_result(tmp_path)
    assert (result.step, result.world_size, result.weights_sha256, result.events) == (2, 2, "2" * 64, record["events"])
    (tmp_path / RESULT_FILE).write_text(json.dumps({k: v for k, v in record.items() if k != "weights_sha256"}))
    with pytest.raises(ManifestError, match="weights_sha256"):
        read_result(tmp_path)


def test_kilns_training_manifest_has_the_fields_of_the_contracts():
    """kiln's writer and the contract's reader name the same wire keys (the reader adds only where it
    read the file from), so a field added on one side alone fails here, not in a run."""
    from kiln_trainer.contract import training_manifest as contract_manifest

    theirs = {f.name for f in dataclasses.fields(contract_manifest.TrainingManifest)} - {"path"}
    assert {f.name for f in dataclasses.fields(TrainingManifest)} == theirs


def test_kiln_reads_of_result_json_only_keys_the_contract_says_the_trainer_writes():
    from kiln_trainer.contract import TrainResultRecord

    assert {f.name for f in dataclasses.fields(TrainResult)} <= set(TrainResultRecord.__annotations__)

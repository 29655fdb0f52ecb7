"""Pipeline stages that need no services: batching, the data gate's completeness check, the run
directory, and the reuse of what an earlier try of a run left there."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kiln import runs, stages
from kiln.errors import DataGateError, KilnError
from kiln.policy import SANDBOX
from kiln.refs import (
    ApprovalAnswer,
    DataGateResult,
    Decision,
    EvalReport,
    PinnedSnapshot,
    RegisteredCandidate,
    ShardReport,
    TrainResult,
)

JSON_BY_DESIGN = {("check_run_conf", "conf"), ("check_run_conf", "params"), ("train_inputs", "params"),
                  ("prepare_train", "params"), ("train_stage", "params"), ("register_stage", "lineage"),
                  ("write_summary", "summary"), ("tokenizer_stage", "params"), ("tokenize_stage", "params"),
                  ("tokens_stage", "params"), ("run_policy", "params"), ("snapshot_run_stage", "params"),
                  ("validate_run_stage", "params"), ("data_gate_run_stage", "params")}
"""What a stage takes as a plain mapping: the run's conf and params (Airflow's form), extra tags, the
summary it writes. Never a plan or a result of another stage."""
NOT_STAGES = {"aliases"}
"""Public helpers of the stage modules that no task calls (the champion watch's registry read)."""


def test_every_stage_takes_and_returns_typed_refs_not_dicts():
    import inspect

    from kiln.stages import champion_watch

    functions = {name: getattr(stages, name) for name in stages.__all__ if inspect.isfunction(getattr(stages, name))}
    functions |= {name: fn for name, fn in inspect.getmembers(champion_watch, inspect.isfunction)
                  if fn.__module__ == champion_watch.__name__ and not name.startswith("_") and name not in NOT_STAGES}
    assert {"snapshot_stage", "data_gate_stage", "finish_train", "register_stage", "reevaluate_stage",
            "watch_outcome_stage"} <= set(functions), "the rule looks at the stages"
    untyped = [f"{name}({param.name}: {param.annotation})" for name, fn in functions.items()
               for param in inspect.signature(fn).parameters.values()
               if "dict[" in str(param.annotation) and (name, param.name) not in JSON_BY_DESIGN]
    untyped += [f"{name}() -> {inspect.signature(fn).return_annotation}" for name, fn in functions.items()
                if "dict[" in str(inspect.signature(fn).return_annotation)]
    assert untyped == [], "a stage takes or returns a free-form dict where a typed ref belongs"


def _run_path(tmp_path: Path, key: str) -> Path:
    from kiln import runs

    return runs.run_dir_path(key, tmp_path / "runs")


def _snapshot_ref(snapshot_id: str = "a" * 32 + ".dir", shards: list[str] | None = None) -> PinnedSnapshot:
    """A snapshot XCom as the DAG's snapshot task pushes it, for stages that read no more than its id
    or shard list (nothing was snapshotted)."""
    return PinnedSnapshot(id=snapshot_id, corpus="stdlib-py", files=1, bytes=1, dvc="", remote="", path="/nonexistent",
                          shards=shards or [])


def test_shard_batches_cover_every_shard_once_in_order():
    snap = _snapshot_ref(shards=[f"train/shard-{i:05d}.parquet" for i in range(10)])
    batches = stages.shard_batches(dataclasses.replace(SANDBOX, validation_batch_shards=4), snap)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [s for b in batches for s in b] == snap.shards


def _pinned_snapshot(name: str = "scratch-corpus", shards: tuple[str, ...] = ("a", "b"), seed: int = 0) -> PinnedSnapshot:
    """A real snapshot of a tiny corpus (shards named ``a.parquet``, ...), pinned the way the DAG's
    snapshot task pins it (its XCom)."""
    import shutil
    import tempfile

    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus

    root = kiln_settings.load().corpus_root / name
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "eval").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        build_corpus(Path(tmp), shards=len(shards), seed=seed, max_bytes=65_536)
        for shard, made in zip(shards, sorted((Path(tmp) / "train").glob("*.parquet")), strict=True):
            shutil.copy(made, root / "train" / f"{shard}.parquet")
        for made in (Path(tmp) / "eval").glob("*.parquet"):
            shutil.copy(made, root / "eval" / made.name)
    return stages.snapshot_stage(SANDBOX, name)


def _report(snap: PinnedSnapshot, shard: str) -> ShardReport:
    return ShardReport(path=str(Path(snap.path) / "train" / f"{shard}.parquet"), sha256="x", rows=1,
                       verdict="healthy", reasons=[], contract="stdlib-py@1")


def _validated(snap: PinnedSnapshot, key: str, shards: list[str] | None = None) -> list[ShardReport]:
    """What one validate_shards task records in the run and pushes as its XCom."""
    return stages.validate_stage(SANDBOX, snap, list(snap.shards if shards is None else shards), key)


def test_data_gate_refuses_a_snapshot_with_unvalidated_shards(home):
    snap = _pinned_snapshot()
    key = "kiln_sandbox/manual__1"
    with pytest.raises(DataGateError, match="never validated.*b.parquet"):
        stages.data_gate_stage(SANDBOX, snap, [_validated(snap, key, ["train/a.parquet"])], key)
    written = sorted(p.name for p in runs.run_dir(key).iterdir())
    assert written == ["run.json", "validation"], "no manifest or report for a run whose shards were not all validated"


def test_data_gate_counts_the_snapshots_shards_not_the_plans_xcom(home):
    """A shard plan (or snapshot XCom) rewritten to leave a shard out does not get it past the gate
    unvalidated; nor does a report of a file that is no shard of the snapshot."""
    snap = _pinned_snapshot()
    key = "kiln_sandbox/manual__1"
    forged = dataclasses.replace(snap, shards=["train/a.parquet"])
    with pytest.raises(DataGateError, match="never validated.*b.parquet"):
        stages.data_gate_stage(SANDBOX, forged, [_validated(forged, key)], key)
    # An XCom can name no shard into being validated: only the validation tasks' records count.
    with pytest.raises(DataGateError, match="never validated.*b.parquet"):
        stages.data_gate_stage(SANDBOX, snap, [[*_validated(forged, key), _report(snap, "b")]], key)
    stray = _report(snap, "c")
    with pytest.raises(DataGateError, match="of no shard of snapshot.*c.parquet"):
        stages.data_gate_stage(SANDBOX, snap, [[*_validated(snap, key), stray]], key)
    assert sorted(p.name for p in runs.run_dir(key).iterdir()) == ["run.json", "validation"], "no manifest or report"


def test_a_verdict_rewritten_in_an_xcom_is_refused_and_the_shard_stays_out(home):
    """A poisoned shard whose validate_shards XCom is rewritten to "healthy" (any Airflow user may
    edit an XCom): the gate reads the validation task's record, refuses the XCom, writes nothing."""
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.errors import RunMismatchError

    build_corpus(kiln_settings.load().corpus_root / "scratch-corpus", shards=2, poison=["secret"])
    snap = stages.snapshot_stage(SANDBOX, "scratch-corpus")
    key = "kiln_sandbox/manual__forged"
    reports = _validated(snap, key)
    assert sorted(r.verdict for r in reports) == ["healthy", "quarantined"]
    healed = [dataclasses.replace(r, verdict="healthy", reasons=[]) for r in reports]
    refused = "disagree with the run's own validation records.*XCom healthy, record quarantined"
    with pytest.raises(RunMismatchError, match=refused):
        stages.data_gate_stage(SANDBOX, snap, [healed], key)
    assert not (runs.run_dir(key) / runs.TRAINING_MANIFEST).exists()
    assert not (runs.run_dir(key) / runs.QUARANTINE_JSON).exists()


def test_validation_reads_the_pinned_snapshot_not_the_path_an_xcom_names(home, tmp_path):
    """A snapshot XCom whose path is rewritten to other bytes: validation still reads the pinned copy."""
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus

    build_corpus(kiln_settings.load().corpus_root / "scratch-corpus", shards=1)
    snap = stages.snapshot_stage(SANDBOX, "scratch-corpus")
    decoy = tmp_path / "decoy"
    build_corpus(decoy, shards=1, poison=["secret"])
    reports = stages.validate_stage(SANDBOX, dataclasses.replace(snap, path=str(decoy)), snap.shards,
                                   "kiln_sandbox/manual__decoy")
    assert [r.path for r in reports] == [str(Path(snap.path) / s) for s in snap.shards]
    assert [r.verdict for r in reports] == ["healthy"], "the decoy's poisoned shard was read"


def test_run_dir_is_keyed_by_dag_and_run(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    d = runs.run_dir(runs.run_key("kiln_production", "scheduled__2026-11-30T03:00:00+00:00"))
    assert d.parent.name.startswith("kiln_production-") and ":" not in d.name and "+" not in d.name
    assert d.parent.parent == tmp_path / "runs"


def test_run_ids_that_differ_only_in_replaced_characters_get_their_own_run_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    dirs = {runs.run_dir(runs.run_key("kiln_sandbox", rid)) for rid in ("probe:col", "probe_col", "probe+col")}
    assert len(dirs) == 3, f"three runs share {dirs}"


def test_an_unreadable_job_record_is_named_and_nothing_is_cancelled(tmp_path, monkeypatch):
    from kiln.errors import LaunchError

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    key = runs.run_key("kiln_sandbox", "manual__1")
    assert stages.cancel_live_job(key) is None  # nothing submitted
    record = runs.run_dir(key) / "train" / ".launch" / runs.JOB_RECORD
    record.parent.mkdir(parents=True)
    for torn in ('{"backend": "slurm", ', '{"backend": "slurm", "options": {}}', '["slurm"]'):
        record.write_text(torn)  # cut short, a key missing, not an object
        with pytest.raises(LaunchError, match=str(record)):
            stages.cancel_live_job(key)


def test_outcome_says_why_nothing_was_promoted(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    candidate = RegisteredCandidate(model_name="sandbox.kiln-stdlib-lm", version="3",
                                    decision=Decision(action="hold", reasons=["threshold: FAILED 9.1 > 8.0"],
                                                      candidate_bits_per_byte=9.1))
    out = stages.outcome_stage(SANDBOX, candidate, None, "kiln_sandbox/manual__2")
    assert out.promoted is False and "hold" in out.message and "9.1 > 8.0" in out.message
    summary = json.loads((_run_path(tmp_path, "kiln_sandbox/manual__2") / "summary.json").read_text())
    assert summary["run_id"] == "manual__2" and summary["promoted"] is False


def test_unknown_run_parameters_are_refused_by_name():
    from kiln.errors import ConfigError
    from kiln.policy import PRODUCTION

    stages.check_run_conf(PRODUCTION, {"reason": "weekly"}, {"reason"})
    with pytest.raises(ConfigError, match="recipe"):
        stages.check_run_conf(PRODUCTION, {"reason": "x", "recipe": "tiny.toml"}, {"reason"})


def test_run_parameters_that_do_not_make_a_recipe_are_refused_in_the_first_task():
    """max_steps=1 passes the form (minimum 1) but is below the recipe's warm-up: refused by name
    before the snapshot, not after validation when the launcher checks the recipe."""
    from kiln.errors import ConfigError

    form = {"recipe": "tiny.toml", "nodes": 1, "max_steps": None, "seed": 1337, "corpus": "stdlib-py"}
    stages.check_run_conf(SANDBOX, {"max_steps": 30}, set(form), {**form, "max_steps": 30})
    with pytest.raises(ConfigError, match=r"\{'max_steps': 1\} do not make a valid recipe: .*warmup_steps = 20: must be <= "
                                          r"train.steps \(1\)"):
        stages.check_run_conf(SANDBOX, {"max_steps": 1}, set(form), {**form, "max_steps": 1})


def test_the_sandbox_form_may_choose_the_parallel_strategy_and_empty_keeps_the_recipes():
    from kiln.stages.inputs import load_run_recipe, train_inputs

    for asked, expected in ((None, "ddp"), ("fsdp", "fsdp"), ("ddp", "ddp")):
        recipe, _, overrides = train_inputs(SANDBOX, {"recipe": "tiny.toml", "strategy": asked})
        assert load_run_recipe(recipe, overrides).parallel.strategy == expected
    recipe, _, overrides = train_inputs(SANDBOX, {"recipe": "production/small-fsdp.toml", "strategy": None})
    assert load_run_recipe(recipe, overrides).parallel.strategy == "fsdp"


def test_batches_grow_so_a_huge_corpus_stays_under_max_map_length():
    snap = _snapshot_ref(shards=[f"train/shard-{i:06d}.parquet" for i in range(100_000)])
    batches = stages.shard_batches(SANDBOX, snap)
    assert len(batches) <= SANDBOX.validation_max_tasks < 1024
    assert sum(len(b) for b in batches) == 100_000


def test_outcome_of_a_timed_out_review_names_no_reviewer(tmp_path, monkeypatch):
    from kiln import registry
    from kiln.policy import PRODUCTION
    from kiln.refs import Review

    recorded = {}
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    key = "kiln_production/scheduled__x"

    def record(**kw):
        recorded.update(kw)
        return Review(subject=registry.promotion_subject(PRODUCTION.candidate_model, kw["candidate_version"]),
                      outcome=kw["outcome"], reviewer=kw["reviewer"], at=kw["at"], run_key=kw["run_key"])

    monkeypatch.setattr(registry, "record_review", record)
    candidate = RegisteredCandidate(model_name=PRODUCTION.candidate_model, version="4",
                                    decision=Decision(action="promote", reasons=["threshold: ok"], candidate_bits_per_byte=3.1))
    review = ApprovalAnswer(chosen_options=["Reject"], responded_by_user={}, timed_out=True,
                            responded_at="2026-11-30T03:00:00")
    stored = stages.review_stage(PRODUCTION, candidate, review, key)  # what the approval task records
    monkeypatch.setattr(registry, "recorded_review", lambda policy, version, run_key: stored)
    out = stages.outcome_stage(PRODUCTION, candidate, None, key)
    assert out.promoted is False and out.review == "timed out" and "timed out" in out.message
    assert recorded["outcome"] == "timed out" and recorded["candidate_version"] == "4"
    assert recorded["run_key"] == key and recorded["reviewer"].startswith("nobody")


def test_an_answer_is_told_in_the_policys_words():
    from kiln.policy import PRODUCTION

    at = "2026-12-01T12:00:00+00:00"
    fab_user = {"id": "7", "name": "reviewer"}  # FAB: the id is a row number, the name is the login
    assert stages.review_in_words(PRODUCTION, ApprovalAnswer(chosen_options=["Approve"], responded_by_user=fab_user,
                                                             responded_at=at)) == ("approved", "reviewer", at)
    assert stages.review_in_words(PRODUCTION, ApprovalAnswer(chosen_options=["Reject"], responded_by_user=fab_user,
                                                             responded_at=at))[0] == "rejected"
    # Someone the policy does not list is named as they are; recording their Approve is refused.
    assert stages.review_in_words(PRODUCTION, ApprovalAnswer(chosen_options=["Approve"],
                                                             responded_by_user={"id": "mallory", "name": "mallory"},
                                                             responded_at=at))[1] == "mallory"
    assert stages.review_in_words(PRODUCTION, ApprovalAnswer(chosen_options=["Approve"], responded_by_user={}))[1] == "unknown"
    outcome, who, _ = stages.review_in_words(PRODUCTION, ApprovalAnswer(chosen_options=["Reject"], timed_out=True))
    assert outcome == "timed out" and who.startswith("nobody (assigned: demo-reviewer, reviewer")


# ------------------------------------------------------------------ reuse of an earlier try's result
def _manifest(tmp_path: Path, snapshot_id: str = "a" * 32 + ".dir", *, key: str | None = None) -> DataGateResult:
    """A training manifest and the data gate's XCom naming it; with ``key``, written where that run's
    data gate writes it (the only manifest its later stages accept)."""
    from kiln.refs import TrainingManifest

    shard = {"path": str(tmp_path / "shard.parquet"), "sha256": "0" * 64, "rows": 1}
    manifest = TrainingManifest.build(snapshot_id=snapshot_id, corpus="stdlib-py", contract="stdlib-py@1",
                                      shards=[shard], eval_shards=[shard])
    path = manifest.write(runs.run_dir(key) / "training-manifest.json" if key
                          else tmp_path / f"manifest-{snapshot_id[:4]}.json")
    return DataGateResult(manifest=str(path), manifest_sha256=manifest.sha256, healthy=1, quarantined=[],
                          quarantine_rate=0.0, report="", report_html="", contract="stdlib-py@1")


def _snapshot_of(data: DataGateResult) -> PinnedSnapshot:
    """The snapshot XCom of the run whose data gate answered ``data``."""
    from kiln.refs import TrainingManifest

    return _snapshot_ref(TrainingManifest.read(data.manifest).snapshot_id)


def _finished_training(key: str, data: DataGateResult, *, seed: int, steps: int) -> TrainResult:
    """A real committed checkpoint and result.json of SANDBOX's default recipe at ``seed``/``steps``
    (no training: one optimizer step of the real model, saved by the trainer's own writer)."""
    import torch

    from kiln.refs import TrainingManifest
    from kiln_trainer.checkpoint import CheckpointIdentity, CheckpointWriter, _torch_save_bytes, capture_rng_state
    from kiln_trainer.checkpoint_manifest import latest_committed, manifest_sha256
    from kiln_trainer.config import load_recipe
    from kiln_trainer.model import GPT

    manifest = TrainingManifest.read(data.manifest)
    recipe = load_recipe(SANDBOX.resolve_recipe(None), [f"train.seed={seed}", f"train.steps={steps}"])
    train_dir = runs.run_dir(key) / "train"
    writer = CheckpointWriter(train_dir, CheckpointIdentity(
        world_size=1, recipe=recipe.to_dict(), recipe_sha256=recipe.sha256, snapshot_id=manifest.snapshot_id,
        training_manifest_sha256=manifest.sha256), keep_last=1, async_save=False)
    model = GPT(recipe.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    writer.save(step=steps, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={"step": steps},
                rng_blobs=[_torch_save_bytes(capture_rng_state())])
    writer.close()
    step_dir = latest_committed(train_dir)
    committed = json.loads((step_dir / "manifest.json").read_text())
    result = {"kind": "kiln.TrainResult", "run_dir": str(train_dir), "checkpoint": str(step_dir),
              "checkpoint_manifest_sha256": manifest_sha256(step_dir), "weights_sha256": committed["weights_sha256"],
              "step": steps, "total_steps": steps, "completed": True, "recipe_sha256": recipe.sha256,
              "training_manifest_sha256": manifest.sha256, "snapshot_id": manifest.snapshot_id, "world_size": 1,
              "metrics": {}, "events": [], "mlflow_run_id": ""}
    (train_dir / "result.json").write_text(json.dumps(result))
    return TrainResult.from_json(result)


def test_a_retry_gets_the_finished_training_it_asked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    key = "kiln_sandbox/manual__1"
    data = _manifest(tmp_path, key=key)
    made = _finished_training(key, data, seed=5, steps=20)
    done = stages.prepare_train(SANDBOX, _snapshot_of(data), data, {"seed": 5, "max_steps": 20}, key)
    assert isinstance(done, TrainResult) and done.weights_sha256 == made.weights_sha256


@pytest.mark.parametrize(
    ("params", "differing"),
    [
        ({"seed": 6, "max_steps": 20}, ["recipe_sha256", "seed"]),
        ({"seed": 5, "max_steps": 25}, ["recipe_sha256", "total_steps"]),
        ({"seed": 5, "max_steps": 20, "nodes": 2}, ["world_size"]),
        ({"seed": 5, "max_steps": 20, "recipe": "small.toml"}, ["recipe_sha256"]),
    ],
)
def test_a_finished_training_made_from_other_inputs_is_refused_naming_each_difference(tmp_path, monkeypatch, params, differing):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    key = "kiln_sandbox/manual__1"
    data = _manifest(tmp_path, key=key)
    _finished_training(key, data, seed=5, steps=20)
    with pytest.raises(KilnError, match="made from other inputs") as info:
        stages.prepare_train(SANDBOX, _snapshot_of(data), data, params, key)
    assert type(info.value).__name__ == "RunMismatchError" and not info.value.retryable
    named = sorted(part.split(":")[0].strip() for part in str(info.value).split("asks for: ")[1].split(";"))
    assert named == differing, str(info.value)


def test_a_finished_training_of_another_manifest_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    key = "kiln_sandbox/manual__1"
    _finished_training(key, _manifest(tmp_path), seed=5, steps=20)
    other = _manifest(tmp_path, snapshot_id="b" * 32 + ".dir", key=key)
    with pytest.raises(KilnError, match="snapshot_id: made 'a+.dir', asked 'b+.dir'.*training_manifest_sha256"):
        stages.prepare_train(SANDBOX, _snapshot_of(other), other, {"seed": 5, "max_steps": 20}, key)


def test_an_evaluation_report_of_another_checkpoint_is_not_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    key = "kiln_sandbox/manual__1"
    data = _manifest(tmp_path, key=key)
    train = _finished_training(key, data, seed=5, steps=20)
    stale = {"kind": "kiln.EvalReport", "checkpoint": "/elsewhere/step-00000020", "weights_sha256": "f" * 64,
             "split": "eval", "bits_per_byte": 2.0, "loss": 1.4, "tokens": 10, "step": 20, "windows": 1,
             "snapshot_id": _snapshot_of(data).id, "training_manifest_sha256": data.manifest_sha256,
             "checkpoint_manifest_sha256": "e" * 64}
    (runs.run_dir(key) / "eval-report.json").write_text(json.dumps(stale))
    with pytest.raises(KilnError, match="checkpoint: made '/elsewhere.*weights_sha256: made 'f+'"):
        stages.evaluate_stage(train, data, key)


def test_the_data_gate_keeps_the_training_manifest_a_run_pinned(home, tmp_path):
    from kiln.refs import TrainingManifest

    key = "kiln_sandbox/manual__1"
    pinned = TrainingManifest.read(_manifest(tmp_path).manifest)
    path = pinned.write(runs.run_dir(key) / "training-manifest.json")
    before = path.read_bytes()
    snap = _pinned_snapshot(shards=("a",))
    with pytest.raises(KilnError, match=f"of snapshot {'a' * 32}.dir; this try's snapshot is {snap.id}"):
        stages.data_gate_stage(SANDBOX, snap, [_validated(snap, key)], key)
    assert path.read_bytes() == before
    assert not (path.parent / "quarantine-report.json").exists(), "nothing published for the other snapshot"


def test_a_finished_result_naming_another_runs_checkpoint_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    theirs = _finished_training("kiln_sandbox/probe_col", _manifest(tmp_path), seed=5, steps=20)
    data = _manifest(tmp_path, key="kiln_sandbox/probe:col")
    ours = _finished_training("kiln_sandbox/probe:col", data, seed=5, steps=20)
    result_file = Path(ours.run_dir) / "result.json"
    result_file.write_text(json.dumps({**ours.to_json(), "checkpoint": theirs.checkpoint}))
    with pytest.raises(KilnError, match="not in this run's training directory"):
        stages.prepare_train(SANDBOX, _snapshot_of(data), data, {"seed": 5, "max_steps": 20}, "kiln_sandbox/probe:col")


# ------------------------------------------------------------------ XComs are references, not records
def _registrable_run(home: Path, tmp_path: Path, key: str) -> tuple[PinnedSnapshot, DataGateResult, TrainResult,
                                                                     EvalReport]:
    """A run whose own records are all in place (pinned snapshot, data gate, training, evaluation):
    the XComs of its snapshot, data_gate, train and evaluate tasks."""
    snap = _pinned_snapshot(shards=("a",))
    data = _manifest(tmp_path, snapshot_id=snap.id, key=key)
    (runs.run_dir(key) / "quarantine-report.json").write_text(json.dumps({"quarantined_share": 0.0}))
    train = _finished_training(key, data, seed=5, steps=20)
    evaluation = {"kind": "kiln.EvalReport", "checkpoint": train.checkpoint, "weights_sha256": train.weights_sha256,
                  "split": "eval", "bits_per_byte": 9.5, "loss": 6.6, "tokens": 10, "step": 20, "windows": 1,
                  "snapshot_id": snap.id, "training_manifest_sha256": data.manifest_sha256,
                  "checkpoint_manifest_sha256": train.checkpoint_manifest_sha256}
    (runs.run_dir(key) / "eval-report.json").write_text(json.dumps(evaluation))
    return snap, data, train, EvalReport.from_json(evaluation)


@pytest.mark.parametrize(("task", "field", "forged"), [
    ("evaluate", "bits_per_byte", 0.5),  # the gate would decide on a forged score
    ("train", "weights_sha256", "0" * 64),
    ("data_gate", "manifest", "/elsewhere/training-manifest.json"),
    ("snapshot", "id", "f" * 32 + ".dir"),
])
def test_registration_refuses_an_xcom_that_disagrees_with_the_runs_own_record(home, tmp_path, monkeypatch, task, field,
                                                                               forged):
    """Any Airflow user may rewrite an XCom; registration writes from the run's own records and
    refuses, before any request to MLflow, an XCom that says otherwise."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens: any request would fail
    key = "kiln_sandbox/manual__1"
    xcoms = dict(zip(("snapshot", "data_gate", "train", "evaluate"), _registrable_run(home, tmp_path, key), strict=True))
    xcoms[task] = dataclasses.replace(xcoms[task], **{field: forged})
    with pytest.raises(KilnError, match=rf"the {task} task's XCom of run {key} .*{field}") as info:
        stages.register_stage(SANDBOX, xcoms["snapshot"], xcoms["data_gate"], xcoms["train"], xcoms["evaluate"], key, {})
    assert type(info.value).__name__ == "RunMismatchError" and not info.value.retryable


def test_evaluation_scores_the_runs_own_checkpoint_not_the_one_an_xcom_names(home, tmp_path):
    key = "kiln_sandbox/manual__1"
    _, data, train, _ = _registrable_run(home, tmp_path, key)
    (runs.run_dir(key) / "eval-report.json").unlink()
    with pytest.raises(KilnError, match=rf"the train task's XCom of run {key} .*checkpoint"):
        stages.evaluate_stage(dataclasses.replace(train, checkpoint="/elsewhere/step-00000020"), data, key)
    assert not (runs.run_dir(key) / "eval-report.json").exists(), "nothing was evaluated"

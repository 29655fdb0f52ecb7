"""The conformance kit's verdicts and its refusals, without starting a trainer (fast).

Each ``judge_*`` reads run directories the way the kit's runs leave them; here they are written by
hand (sample logs, results, metrics records, fatal markers, the launcher's elastic record) and, where
weights are compared, as real committed checkpoints (``trainer_fixtures.write_checkpoints``). Every guarantee has its pass and the
failures a trainer can commit, each named by its letter and its reason. The kit against real
trainers: tests/integration/test_conformance.py and test_hf_trainer.py. About 4 s on 2 cores.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli import main as kiln_main
from kiln.conformance import KIT_KEYS, KitSpec, check_inputs
from kiln.conformance.checks import (
    KillRecord,
    NodeLossRecord,
    RunOutcome,
    judge_bad_manifest,
    judge_kill_resume,
    judge_node_loss,
    judge_straggler,
    judge_world_size_resume,
    max_weight_difference,
)
from kiln.conformance.runs import edited_manifest, resumable_copy
from kiln.errors import ConfigError
from kiln.launchers.elastic import Shrink, record_shrink
from kiln.launchers.worker import write_fatal_marker
from kiln_trainer.contract.training_manifest import load_training_manifest
from kiln_trainer.errors import TrainingManifestError

from trainer_fixtures import REPO, stdlib_sources, write_checkpoints, write_shard, write_training_manifest

TINY = REPO / "training" / "recipes" / "tiny.toml"
STEPS, AT, BATCH = 6, 2, 4


def _ids(step: int) -> list[int]:
    return [(7 * step + 3 * i) % 50 for i in range(BATCH)]


def _sample_log(run_dir: Path, worlds: list[int], *, ids=_ids, rank0_steps: list[int] | None = None) -> None:
    """One line per rank and step, each rank its contiguous share; ``rank0_steps`` overrides the
    order rank 0 logged its steps in (a restart logs some again)."""
    folder = run_dir / "sample-log"
    folder.mkdir(parents=True, exist_ok=True)
    lines: dict[int, list[str]] = {}
    for step, world in enumerate(worlds):
        share = BATCH // world
        for rank in range(world):
            line = {"step": step, "consumed_before": step * BATCH, "epoch": 0, "rank": rank, "world_size": world,
                    "sample_ids": ids(step)[rank * share:(rank + 1) * share]}
            lines.setdefault(rank, []).append(json.dumps(line))
    if rank0_steps is not None:
        by_step = {json.loads(line)["step"]: line for line in lines[0]}
        lines[0] = [by_step[s] for s in rank0_steps]
    for rank, text in lines.items():
        (folder / f"rank-{rank:05d}.jsonl").write_text("".join(f"{t}\n" for t in text))


def _result(run_dir: Path, *, sha: str = "a" * 64, world: int = 2, loss: float = 2.0, checkpoint: Path | None = None,
            events: tuple[dict, ...] = (), completed: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "result.json").write_text(json.dumps({
        "weights_sha256": sha, "world_size": world, "step": STEPS, "completed": completed,
        "checkpoint": str(checkpoint or run_dir / "checkpoints" / "step-00000006"), "metrics": {"final_loss": loss},
        "events": list(events)}))


def _metrics(run_dir: Path, *records: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")


def _done(run_dir: Path, log: str = "") -> RunOutcome:
    return RunOutcome(run_dir=run_dir, state="SUCCEEDED", log=log)


# -- (a) bitwise resume after a SIGKILL mid-save -----------------------------------------------------------


def _kill(**changes) -> KillRecord:
    return KillRecord(**{"save_step": 4, "torn": True, "committed_step": 2, "node": 0, "pid": 123, **changes})


@pytest.fixture
def killed_pair(tmp_path: Path) -> tuple[RunOutcome, RunOutcome]:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    _result(reference)
    _result(killed)
    _sample_log(killed, [2] * STEPS, rank0_steps=[0, 1, 2, 3, 2, 3, 4, 5])  # restarted at step 2
    return _done(reference), _done(killed)


def test_a_passes_on_a_restart_from_the_committed_step_to_the_same_weights(killed_pair) -> None:
    check = judge_kill_resume(*killed_pair, _kill())
    assert check.passed, check.reason
    assert check.facts["resumed_from_step"] == 2 and "node 0" in check.reason


def test_a_fails_naming_both_digests_when_the_weights_differ(killed_pair) -> None:
    reference, killed = killed_pair
    _result(killed.run_dir, sha="b" * 64)
    check = judge_kill_resume(reference, killed, _kill())
    assert not check.passed and check.line().startswith("(a) FAIL")
    assert "bbbbbbbbbbbbbbbb" in check.reason and "aaaaaaaaaaaaaaaa" in check.reason and "resumed from step 2" in check.reason


def test_a_fails_a_trainer_that_starts_over_or_never_restarts(killed_pair) -> None:
    reference, killed = killed_pair
    _sample_log(killed.run_dir, [2] * STEPS, rank0_steps=[0, 1, 2, 3, 0, 1, 2, 3, 4, 5])
    check = judge_kill_resume(reference, killed, _kill())
    assert not check.passed and "resumed at step 0, not from the newest committed checkpoint (step 2)" in check.reason
    _sample_log(killed.run_dir, [2] * STEPS)
    check = judge_kill_resume(reference, killed, _kill())
    assert not check.passed and "never started again from a checkpoint" in check.reason


def test_a_is_inconclusive_when_the_kill_missed_the_save_and_fails_when_the_run_does(killed_pair) -> None:
    reference, killed = killed_pair
    check = judge_kill_resume(reference, killed, _kill(torn=False))
    assert not check.passed and check.reason.startswith("inconclusive") and "step 4" in check.reason
    failed = RunOutcome(run_dir=killed.run_dir, state="FAILED", reason="restarts are spent", log="a\nboom")
    check = judge_kill_resume(reference, failed, _kill())
    assert not check.passed and "ended FAILED: restarts are spent" in check.reason and "boom" in check.reason
    check = judge_kill_resume(RunOutcome(run_dir=reference.run_dir, state="FATAL", reason="rank 0 exited 2"), killed,
                              _kill())
    assert not check.passed and "uninterrupted reference run ended FATAL: rank 0 exited 2" in check.reason


def test_a_fails_when_a_checkpoint_that_looks_committed_does_not_verify(killed_pair) -> None:
    reference, killed = killed_pair
    write_checkpoints(killed.run_dir, [2])
    (killed.run_dir / "checkpoints" / "step-00000002" / "scheduler.pt").write_bytes(b"torn")
    check = judge_kill_resume(reference, killed, _kill())
    assert not check.passed and "does not verify" in check.reason and "scheduler.pt" in check.reason


# -- (b) resume at another world size ---------------------------------------------------------------------


@pytest.fixture
def resumed_pair(tmp_path: Path) -> tuple[RunOutcome, RunOutcome]:
    """A 2-rank reference and its resume on 1 rank at step 2, the same weights (real checkpoints)."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    write_checkpoints(reference, [6])
    write_checkpoints(resumed, [6])
    _result(reference)
    _result(resumed, world=1)
    _sample_log(reference, [2] * STEPS)
    _sample_log(resumed, [2] * AT + [1] * (STEPS - AT))
    _metrics(resumed, {"step": AT, "event": "world_size_change", "from_world_size": 2, "to_world_size": 1, "at_step": AT})
    return _done(reference), _done(resumed)


def _judge_b(reference: RunOutcome, resumed: RunOutcome, **changes):
    return judge_world_size_resume(reference, resumed, **{"steps": STEPS, "at_step": AT, "from_world": 2, "to_world": 1,
                                                         "weights_atol": 1e-5, "loss_rtol": 1e-5, **changes})


def test_b_passes_on_the_same_batches_recorded_change_and_weights(resumed_pair) -> None:
    check = _judge_b(*resumed_pair)
    assert check.passed, check.reason
    assert check.facts["max_weight_difference"] == 0.0


def test_b_fails_naming_the_first_step_that_trained_on_other_samples(resumed_pair) -> None:
    reference, resumed = resumed_pair
    _sample_log(resumed.run_dir, [2] * AT + [1] * (STEPS - AT), ids=lambda s: _ids(s) if s < 4 else _ids(s + 1))
    check = _judge_b(reference, resumed)
    assert not check.passed and check.line().startswith("(b) FAIL")
    assert "step 5 trained on other samples at world size 1" in check.reason


def test_b_fails_when_the_change_is_not_recorded_or_the_world_did_not_change(resumed_pair) -> None:
    reference, resumed = resumed_pair
    (resumed.run_dir / "metrics.jsonl").unlink()
    check = _judge_b(reference, resumed)
    assert not check.passed and "no world_size_change event (2 -> 1 ranks at step 2)" in check.reason
    _sample_log(resumed.run_dir, [2] * STEPS)
    check = _judge_b(reference, resumed)
    assert not check.passed and "read by world sizes [2, 2, 2, 2], not 1" in check.reason


def test_b_fails_beyond_the_tolerance_naming_it(resumed_pair, tmp_path: Path) -> None:
    reference, resumed = resumed_pair
    write_checkpoints(tmp_path / "further", [6, 8])  # step 8's weights: two more optimizer steps
    _result(resumed.run_dir, world=1, checkpoint=tmp_path / "further" / "checkpoints" / "step-00000008")
    check = _judge_b(reference, resumed)
    assert not check.passed and "more than the tolerance 1e-05" in check.reason
    assert check.facts["max_weight_difference"] > 1e-5
    _result(resumed.run_dir, world=1, loss=2.5)
    check = _judge_b(reference, resumed)
    assert not check.passed and "final loss 2.5 differs from the uninterrupted run's 2.0" in check.reason


def test_b_fails_a_trainer_that_keeps_no_sample_log(resumed_pair) -> None:
    reference, resumed = resumed_pair
    for log in (resumed.run_dir / "sample-log").iterdir():
        log.unlink()
    check = _judge_b(reference, resumed)
    assert not check.passed and "no sample log" in check.reason and "KILN_SAMPLE_LOG" in check.reason


def test_max_weight_difference_reads_two_checkpoints(tmp_path: Path) -> None:
    write_checkpoints(tmp_path / "a", [2, 4])
    a2, a4 = (tmp_path / "a" / "checkpoints" / f"step-0000000{s}" for s in (2, 4))
    assert max_weight_difference(a2, a2) == 0.0
    assert max_weight_difference(a4, a2) > 0.0


# -- (c) a straggler flagged ------------------------------------------------------------------------------


def _window(step: int, times: list[float], flagged: int = -1) -> dict:
    return {"step": step, "rank_step_times": times, "straggler_rank": flagged}


def test_c_passes_when_the_slowed_rank_is_flagged_and_the_launcher_acted(tmp_path: Path) -> None:
    _metrics(tmp_path, _window(1, [0.01, 0.5]), {"step": 2, "event": "straggler", "rank": 1, "ratio": 50.0},
             _window(2, [0.01, 0.5], 1))
    check = judge_straggler(_done(tmp_path, "[launcher] straggler: rank 1 on node node1 -> policy action: alert"),
                            slow_rank=1, slow_from_step=1)
    assert check.passed and check.facts["flagged_at_step"] == 2


def test_c_fails_naming_the_windows_when_nobody_is_flagged(tmp_path: Path) -> None:
    _metrics(tmp_path, _window(1, [0.51, 0.52]), _window(2, [0.5, 0.5]))
    check = judge_straggler(_done(tmp_path), slow_rank=1, slow_from_step=1)
    assert not check.passed and check.line().startswith("(c) FAIL")
    assert "never flagged" in check.reason and "[0.5, 0.5]" in check.reason  # both ranks looked as slow


def test_c_fails_when_the_waiting_rank_is_flagged_or_nobody_acts(tmp_path: Path) -> None:
    _metrics(tmp_path, {"step": 2, "event": "straggler", "rank": 0, "ratio": 4.0})
    check = judge_straggler(_done(tmp_path), slow_rank=1, slow_from_step=1)
    assert not check.passed and "rank 0 was flagged at step 2, but only rank 1 was slowed" in check.reason
    (tmp_path / "metrics.jsonl").unlink()
    _metrics(tmp_path, {"step": 2, "event": "straggler", "rank": 1, "ratio": 4.0})
    check = judge_straggler(_done(tmp_path, "no launcher line"), slow_rank=1, slow_from_step=1)
    assert not check.passed and "never acted on it" in check.reason


# -- (d) a bad manifest refused before step 1 ----------------------------------------------------------


def test_d_passes_on_exit_2_with_a_marker_naming_the_manifest(tmp_path: Path) -> None:
    write_fatal_marker(tmp_path, 0, "TrainingManifestError: m.json: content hash mismatch")
    check = judge_bad_manifest(RunOutcome(run_dir=tmp_path, state="EXITED 1"), manifest=tmp_path / "m.json")
    assert check.passed and "content hash mismatch" in check.reason


def test_d_fails_a_trainer_that_trains_or_exits_0_or_1_or_gives_no_reason(tmp_path: Path) -> None:
    outcome = RunOutcome(run_dir=tmp_path, state="EXITED 0")
    check = judge_bad_manifest(outcome, manifest=tmp_path / "m.json")
    assert not check.passed and check.line().startswith("(d) FAIL") and "exited 0" in check.reason
    check = judge_bad_manifest(RunOutcome(run_dir=tmp_path, state="EXITED 1"), manifest=tmp_path / "m.json")
    assert not check.passed and "did not exit 2 (no fatal marker" in check.reason and "restart" in check.reason
    write_fatal_marker(tmp_path, 0, "")
    check = judge_bad_manifest(RunOutcome(run_dir=tmp_path, state="EXITED 1"), manifest=tmp_path / "m.json")
    assert not check.passed and "does not name the manifest" in check.reason
    _metrics(tmp_path, {"step": 1, "loss": 5.0})
    check = judge_bad_manifest(RunOutcome(run_dir=tmp_path, state="EXITED 1"), manifest=tmp_path / "m.json")
    assert not check.passed and "got past step 1" in check.reason and "logged steps [1]" in check.reason


# -- (e) an elastic shrink after a node is lost mid-training ------------------------------------------------


def _shrunk_sample_log(run_dir: Path, *, started: int, at: int, ids=_ids) -> None:
    """The lost 2-rank group read steps 1..``started``; the rank left read ``at + 1``..STEPS again."""
    folder = run_dir / "sample-log"
    folder.mkdir(parents=True, exist_ok=True)
    lines: dict[int, list[dict]] = {0: [], 1: []}
    for step in range(started):
        for rank in range(2):
            lines[rank].append({"step": step, "rank": rank, "world_size": 2,
                                "sample_ids": _ids(step)[rank * BATCH // 2:(rank + 1) * BATCH // 2]})
    for step in range(at, STEPS):
        lines[0].append({"step": step, "rank": 0, "world_size": 1, "sample_ids": ids(step)})
    for rank, records in lines.items():
        (folder / f"rank-{rank:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _change(at: int = AT, **changes) -> dict:
    return {"kind": "world_size_change", "from_world_size": 2, "to_world_size": 1, "at_step": at, "accum_steps": 2,
            **changes}


def _loss(**changes) -> NodeLossRecord:
    return NodeLossRecord(**{"node": 0, "agent_pid": 11, "worker_pid": 12, "committed_step": AT, **changes})


@pytest.fixture(scope="module")
def shrunk_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real checkpoints, written once: the reference's step 6 at world size 2; the shrunk run's step 2
    at world size 2 and step 6 at 1, with the reference's step-6 weights."""
    root = tmp_path_factory.mktemp("shrunk-checkpoints")
    write_checkpoints(root / "reference", [6], world_size=2)
    write_checkpoints(root / "shrunk", [AT], world_size=2)
    write_checkpoints(root / "shrunk", [6], world_size=1)
    return root


@pytest.fixture
def shrunk_pair(shrunk_checkpoints: Path, tmp_path: Path) -> tuple[RunOutcome, RunOutcome]:
    """A 2-rank reference and a run that lost node 0 at step 3 and went on on 1 rank from step 2."""
    reference = shutil.copytree(shrunk_checkpoints / "reference", tmp_path / "reference")
    shrunk = shutil.copytree(shrunk_checkpoints / "shrunk", tmp_path / "shrunk")
    _result(reference)
    _result(shrunk, world=1, events=(_change(),))
    _sample_log(reference, [2] * STEPS)
    _shrunk_sample_log(shrunk, started=3, at=AT)
    record_shrink(shrunk, Shrink(backend="local", job_id="1", lost="node 0 (agent killed by signal 9)", from_nodes=2,
                                 to_nodes=1, timeout_s=1, no_replacement="no spare node slot left", time=0.0))
    return _done(reference), _done(shrunk)


def _judge_e(reference: RunOutcome, shrunk: RunOutcome, loss: NodeLossRecord | None = None, **changes):
    return judge_node_loss(reference, shrunk, loss or _loss(), **{
        "steps": STEPS, "every_steps": AT, "from_world": 2, "to_world": 1, "weights_atol": 1e-5, "loss_rtol": 1e-5,
        **changes})


def test_e_passes_on_a_recorded_shrink_resumed_from_the_newest_commit_on_the_same_batches(shrunk_pair) -> None:
    check = _judge_e(*shrunk_pair)
    assert check.passed, check.reason
    facts = check.facts
    assert (facts["resumed_at_step"], facts["last_step_started"], facts["steps_lost"], facts["steps_lost_bound"]) == (
        2, 3, 1, 2)
    assert facts["checkpoints"] == {"2": 2, "6": 1} and facts["max_weight_difference"] == 0.0
    assert "shrank 2 -> 1 node(s)" in check.reason and "resumed at world size 1 from step 2" in check.reason


def test_e_allows_one_more_interval_for_a_save_in_flight_and_no_more(shrunk_pair) -> None:
    reference, shrunk = shrunk_pair
    _shrunk_sample_log(shrunk.run_dir, started=5, at=AT)  # step 4 trained, its save never committed
    check = _judge_e(reference, shrunk)
    assert check.passed and check.facts["saves_in_flight"] == [4] and check.facts["steps_lost_bound"] == 4
    check = _judge_e(reference, shrunk, every_steps=1)  # steps 3 and 4 due: 3 lost, over one interval's 2
    assert not check.passed and check.line().startswith("(e) FAIL")
    assert "3 steps lost, more than a checkpoint interval of 1 allows (2" in check.reason


def test_e_fails_a_resume_from_an_older_checkpoint_than_the_newest(shrunk_pair) -> None:
    reference, shrunk = shrunk_pair
    write_checkpoints(shrunk.run_dir, [4], world_size=2)
    check = _judge_e(reference, shrunk)
    assert not check.passed and "resumed at step 2, not from the newest checkpoint the lost group committed (step 4" in (
        check.reason)


def test_e_fails_when_the_result_does_not_record_the_shrink(shrunk_pair) -> None:
    reference, shrunk = shrunk_pair
    _result(shrunk.run_dir, world=1)
    check = _judge_e(reference, shrunk)
    assert not check.passed and "events hold no world_size_change from 2 to 1 ranks" in check.reason
    _result(shrunk.run_dir, world=2, events=(_change(),))
    check = _judge_e(reference, shrunk)
    assert not check.passed and "completed=True at step 6 on world size 2, not a completed 6 steps on 1" in check.reason


def test_e_fails_naming_the_first_step_after_the_shrink_on_other_samples(shrunk_pair) -> None:
    reference, shrunk = shrunk_pair
    _shrunk_sample_log(shrunk.run_dir, started=3, at=AT, ids=lambda s: _ids(s) if s < 3 else _ids(s + 1))
    check = _judge_e(reference, shrunk)
    assert not check.passed and "step 4 trained on other samples than the uninterrupted run" in check.reason


def test_e_fails_beyond_the_weights_tolerance(shrunk_pair, tmp_path: Path) -> None:
    reference, shrunk = shrunk_pair
    write_checkpoints(tmp_path / "further", [6, 8])
    _result(shrunk.run_dir, world=1, events=(_change(),), checkpoint=tmp_path / "further" / "checkpoints" / "step-00000008")
    check = _judge_e(reference, shrunk)
    assert not check.passed and "after the shrink a final weight differs by" in check.reason


def test_e_is_inconclusive_when_no_node_was_lost_mid_training_and_fails_when_the_job_does(shrunk_pair) -> None:
    reference, shrunk = shrunk_pair
    check = _judge_e(reference, shrunk, _loss(agent_pid=None, worker_pid=None, committed_step=None))
    assert not check.passed and check.reason.startswith("inconclusive") and "never killed" in check.reason
    (shrunk.run_dir / ".launch" / "elastic.json").unlink()
    late = RunOutcome(run_dir=shrunk.run_dir, state="SUCCEEDED", reason="node 0 lost after training finished")
    check = _judge_e(reference, late)
    assert not check.passed and check.reason.startswith("inconclusive") and "after training had finished" in check.reason
    check = _judge_e(reference, shrunk)
    assert not check.passed and "kiln's launcher recorded no elastic shrink" in check.reason
    failed = RunOutcome(run_dir=shrunk.run_dir, state="FAILED", reason="node 1: torchrun exited 1", log="x\nhung")
    check = _judge_e(reference, failed)
    assert not check.passed and "SIGKILLed with step 2 committed and no node to replace it, the run ended FAILED" in (
        check.reason) and "hung" in check.reason


# -- the runs' inputs ---------------------------------------------------------------------------------


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = stdlib_sources(6_000)
    return write_training_manifest(corpus / "manifest.json", [write_shard(corpus / "train.parquet", docs)],
                                   [write_shard(corpus / "eval.parquet", docs[:1])])


def test_the_edited_manifest_fails_its_own_hash(manifest: Path, tmp_path: Path) -> None:
    load_training_manifest(manifest)
    with pytest.raises(TrainingManifestError, match="content hash mismatch"):
        load_training_manifest(edited_manifest(manifest, tmp_path / "edited.json"))


def test_resumable_copy_keeps_the_run_up_to_its_checkpoint(tmp_path: Path) -> None:
    source = tmp_path / "source"
    write_checkpoints(source, [2, 4, 6])
    _result(source)
    _sample_log(source, [2] * STEPS)
    (source / ".launch").mkdir()
    copy = resumable_copy(source, tmp_path / "copy", AT)
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step-00000002"]
    assert not (copy / "result.json").exists() and not (copy / ".launch").exists()
    assert [json.loads(line)["step"] for line in (copy / "sample-log" / "rank-00000.jsonl").read_text().splitlines()] == [0, 1]


def test_the_kit_refuses_bad_settings_naming_them(tmp_path: Path, manifest: Path) -> None:
    kit = {"recipe": TINY, "manifest": manifest, "work_dir": tmp_path / "work"}
    with pytest.raises(ConfigError, match=r"drop \['train.steps=9'\]"):
        KitSpec(**kit, overrides=("train.steps=9",))
    assert "checkpoint.every_steps" in KIT_KEYS
    with pytest.raises(ConfigError, match="at least 2 x every_steps"):
        KitSpec(**kit, steps=3, every_steps=2)
    with pytest.raises(ConfigError, match="world_size must be >= 2"):
        KitSpec(**kit, world_size=1)
    with pytest.raises(ConfigError, match="resume_world_size must be >= 1 and differ"):
        KitSpec(**kit, resume_world_size=2)
    with pytest.raises(ConfigError, match=r"some of \['a', 'b', 'c', 'd', 'e'\], got \['f'\]"):
        KitSpec(**kit, guarantees=("f",))


def test_the_kit_checks_its_inputs_before_any_run(tmp_path: Path, manifest: Path) -> None:
    good = {"recipe": TINY, "manifest": manifest, "overrides": ("optim.warmup_steps=2",)}
    assert check_inputs(KitSpec(**good, work_dir=tmp_path / "new")) == "kiln"
    with pytest.raises(ConfigError, match="warmup_steps"):  # the recipe as the kit runs it (6 steps)
        check_inputs(KitSpec(recipe=TINY, manifest=manifest, work_dir=tmp_path / "new"))
    with pytest.raises(ConfigError, match="no_such_pkg"):
        check_inputs(KitSpec(**{**good, "overrides": (*good["overrides"], 'trainer.train="no_such_pkg.t:main"')},
                             work_dir=tmp_path / "new"))
    with pytest.raises(ConfigError, match="--manifest .*content hash mismatch"):
        check_inputs(KitSpec(**{**good, "manifest": edited_manifest(manifest, tmp_path / "e.json")},
                             work_dir=tmp_path / "new"))
    (tmp_path / "used" / "reference").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"work dir .*used is not empty \(\['reference'\]\)"):
        check_inputs(KitSpec(**good, work_dir=tmp_path / "used"))


def test_the_command_refuses_a_bad_argument_with_exit_2(tmp_path: Path, manifest: Path, capsys) -> None:
    base = ["conformance", "--recipe", str(TINY), "--manifest", str(manifest), "--work-dir", str(tmp_path / "w")]
    assert kiln_main([*base, "--set", "checkpoint.keep_last=1"]) == 2
    assert "kiln conformance: error: the kit sets" in capsys.readouterr().err
    assert kiln_main(["conformance", "--recipe", str(tmp_path / "nope.toml"), "--manifest", str(manifest),
                      "--work-dir", str(tmp_path / "w")]) == 2
    assert "--recipe" in capsys.readouterr().err and not (tmp_path / "w").exists()


def test_the_kit_imports_nothing_of_airflow_mlflow_or_torch() -> None:
    """It runs wherever kiln's worker runs: the trainer image has kiln without its dependencies."""
    code = ("import sys, kiln.conformance, kiln.conformance.runs, kiln.cli.conformance; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'airflow', 'mlflow', 'dvc', 'great_expectations', "
            "'torch', 'pyarrow'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"

"""The chaos suite's short subset (fixed seed, one trial of three families) and its harness.

The subset runs real faults: a worker SIGKILLed while an asynchronous checkpoint write is in flight
(2-node local job), a bit flip in a committed checkpoint (real resume, real ``register_candidate``),
and a DVC push to a moto S3 remote cut in the middle. The full suite is ``make chaos``
(docs/reliability.md). Each trial here is the same trial ``make chaos SEED=11 TRIAL=<name>`` runs.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln_devtools.chaos.core import Context, TrialResult, parse_only, parse_trial, trial_rng

SEED = 11


def _ctx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Context:
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return Context(seed=SEED, work=tmp_path, log=print)


def _explain(result: TrialResult) -> str:
    return f"{result.name} ({result.fault}): {result.outcome}; {result.losses}; {result.detail[-2000:]}"


# ------------------------------------------------------------------------------------------- harness


def test_trial_choices_depend_on_seed_family_and_index_only() -> None:
    from kiln_devtools.chaos.training import plan_kill

    assert plan_kill(SEED, 5) == plan_kill(SEED, 5)
    assert len({str(plan_kill(s, 5)) for s in range(20)}) > 1, "the seed must change the draw"
    assert trial_rng(1, "kill", 0).random() != trial_rng(1, "corrupt", 0).random()
    modes = [plan_kill(SEED, i)["mode"] for i in range(8)]
    assert sorted(set(modes)) == ["node", "node_mid_save", "worker", "worker_mid_save"]
    # Every mode with each strategy: ddp for indices 0-3, fsdp for 4-7.
    assert {(plan_kill(SEED, i)["mode"], plan_kill(SEED, i)["strategy"]) for i in range(8)} == {
        (m, st) for m in modes for st in ("ddp", "fsdp")}


def test_bad_family_or_trial_names_what_is_wrong() -> None:
    known = ["kill", "corrupt"]
    assert parse_trial("kill:3", known) == ("kill", 3)
    with pytest.raises(ConfigError, match="FAMILY:INDEX"):
        parse_trial("kill", known)
    with pytest.raises(ConfigError, match=r"unknown chaos family \['kil'\]; known: kill, corrupt"):
        parse_only("kil", known)


def test_runner_refuses_bad_arguments_with_a_usage_error(capsys) -> None:
    from kiln_devtools.chaos.runner import main

    with pytest.raises(SystemExit) as info:
        main(["--trial", "nosuch:1"])
    assert info.value.code == 2 and "unknown chaos family ['nosuch']" in capsys.readouterr().err


def test_report_names_the_seed_the_machine_and_how_to_replay_a_loss() -> None:
    from kiln_devtools.chaos.core import machine_facts
    from kiln_devtools.chaos.runner import render_report

    results = [
        TrialResult(family="corrupt", index=0, seed=42, outcome="recovered", fault="bitflip a", facts={"resume_refused": True,
                    "register_refused": True, "verify_refused": True, "kind": "bitflip", "file": "model.pt"}),
        TrialResult(family="corrupt", index=1, seed=42, outcome="lost", fault="truncate b", losses=["resume loaded it"],
                    facts={"kind": "truncate", "file": "optimizer.pt"}),
    ]
    machine = {**machine_facts(), "load_end": [1.0, 1.0, 1.0]}
    text = render_report(results, seed=42, machine=machine, seconds=60, plan={"corrupt": [0, 1]}, command="x")
    assert "seed: **42**" in text and f"{machine['cpus']} cores" in text and "load average" in text
    assert "`make chaos SEED=42 TRIAL=corrupt:1`" in text and "resume loaded it" in text
    assert "by resume: 1/2 (50%, goal 100%)" in text


def test_a_rewritten_report_keeps_the_sections_the_chaos_suite_does_not_write(tmp_path: Path) -> None:
    from kiln_devtools.chaos.runner import keep_other_sections

    report = tmp_path / "reliability.md"
    assert keep_other_sections(report, "# new run\n") == "# new run\n"  # no old report
    report.write_text("# old run\n\nold figures\n\n## Generated bad input\n\n400 confs, 1 found\n")
    assert keep_other_sections(report, "# new run\n\n") == "# new run\n\n## Generated bad input\n\n400 confs, 1 found\n"
    report.write_text("# old run, nothing kept\n")
    assert keep_other_sections(report, "# new run\n") == "# new run\n"


def test_remote_proxy_goes_down_and_comes_back_on_the_same_port() -> None:
    from kiln_devtools.chaos.data_faults import RemoteProxy

    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(4)
    proxy = RemoteProxy(upstream.getsockname()[1])
    try:
        proxy.up()
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
        proxy.down()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        proxy.up()
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
    finally:
        proxy.down()
        upstream.close()


# ------------------------------------------------------------------------------ the subset (real faults)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("index", "strategy"), [(2, "ddp"), (6, "fsdp")])
def test_worker_killed_during_an_async_checkpoint_write_resumes_to_identical_weights(
    tmp_path, monkeypatch, index: int, strategy: str
) -> None:
    from kiln_devtools.chaos.training import KILL, plan_kill

    assert plan_kill(SEED, index)["mode"] == "worker_mid_save" and plan_kill(SEED, index)["strategy"] == strategy
    (result,) = KILL.run(_ctx(tmp_path, monkeypatch), [index])
    assert result.outcome == "recovered", _explain(result)
    facts = result.facts
    assert facts["torn_write_at_kill"] and facts["weights_match"] and facts["corrupt_committed"] == 0
    # A write in flight when the worker died may still commit (rank 0 lives on): then nothing is lost.
    # The last *logged* step can lag the step whose save was in flight (seen: logged 29, saving 30).
    assert facts["resumed_from_step"] <= max(facts["killed_at_step"], facts["torn_step"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_bit_flip_in_a_committed_checkpoint_is_refused_by_resume_and_registration(tmp_path, monkeypatch) -> None:
    from kiln_devtools.chaos.training import CORRUPT

    (result,) = CORRUPT.run(_ctx(tmp_path, monkeypatch), [1])
    assert result.facts["kind"] == "bitflip"
    assert result.outcome == "recovered", _explain(result)
    assert result.facts["verify_refused"] and result.facts["resume_refused"] and result.facts["register_refused"]
    assert result.facts["completed"], "the resumed run must finish, the damaged step rewritten"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_push_cut_mid_way_records_nothing_and_succeeds_once_the_remote_is_back(tmp_path, monkeypatch) -> None:
    from kiln_devtools.chaos.data_faults import SNAPSHOT

    (result,) = SNAPSHOT.run(_ctx(tmp_path, monkeypatch), [1])
    assert result.facts["mode"] == "cut_mid_push"
    assert result.outcome == "recovered", _explain(result)
    assert result.facts["failed_while_down"] and result.facts["partial_recorded"] == 0
    assert result.facts["recorded_after_recovery"] == 1

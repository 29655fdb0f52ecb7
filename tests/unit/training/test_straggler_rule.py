"""Straggler rule, its actions, the slow-rank fault switch and the per-rank Prometheus series (fast,
no processes: the end-to-end run is tests/integration/test_stragglers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.errors import ConfigError
from kiln.launchers.stragglers import StragglerPolicy, StragglerWatch, straggler_events
from kiln_trainer.errors import TrainerError
from kiln_trainer.faults import SlowRankFault
from kiln_trainer.metrics import PrometheusTextfileSink
from kiln_trainer.stragglers import StragglerMonitor, slow_ranks
from kiln_trainer.timing import StepClock, StepMarks


def test_slow_ranks_compares_each_rank_with_the_others_median():
    assert slow_ranks([0.1, 0.1, 0.35, 0.1], 3.0) == [(2, 0.35, 0.1)]
    assert slow_ranks([0.1, 0.29], 3.0) == []
    assert slow_ranks([0.5], 1.5) == []


def test_monitor_flags_after_k_windows_reports_current_and_clears():
    monitor = StragglerMonitor(factor=2.0, windows=3, nodes=["a", "b"])
    seen = [monitor.observe(step, [0.1, 0.5]) for step in (5, 10)]
    assert seen == [([], []), ([], [])] and monitor.current == -1
    flags, cleared = monitor.observe(15, [0.1, 0.5])
    assert [(f.rank, f.step, f.node) for f in flags] == [(1, 15, "b")] and cleared == []
    assert monitor.current == 1 and flags[0].ratio == pytest.approx(5.0)
    assert "rank 1 on node b at step 15" in flags[0].message
    event = flags[0].to_event()
    assert event["event"] == "straggler" and event["rank"] == 1 and event["node"] == "b"
    assert monitor.observe(20, [0.1, 0.5]) == ([], [])  # one flag per streak
    assert monitor.observe(25, [0.1, 0.11]) == ([], [1]) and monitor.current == -1


def test_step_marks_subtract_the_time_blocked_in_collectives():
    clock = StepClock(torch.device("cpu"))
    marks = StepMarks(start=10.0, ready=10.3, reduced=10.8, end=11.0)
    compute, wall = marks.compute_and_wall(clock)
    assert (round(compute, 6), round(wall, 6)) == (0.5, 1.0)
    # fsdp: the seconds inside its all-gathers and reduce-scatters are blocked too
    marks = StepMarks(start=10.0, ready=10.3, reduced=10.8, end=11.0, collective_s=0.2)
    assert round(marks.compute_and_wall(clock)[0], 6) == 0.3


def test_fsdps_timed_collectives_give_fsdps_results_and_add_their_seconds():
    """The all-gather and reduce-scatter kiln hands FSDP2 on the CPU are FSDP2's own calls, timed (the
    whole effect, on 2 ranks with one slowed, is the conformance kit's (c) on the fsdp example)."""
    import torch.distributed as dist

    from kiln_trainer.parallel import _timed_collectives
    from kiln_trainer.timing import CollectiveWait

    from trainer_fixtures import group_of_one

    wait = CollectiveWait()
    all_gather, reduce_scatter = _timed_collectives(wait)
    with group_of_one():
        group = dist.group.WORLD
        assert group is not None
        gathered = all_gather.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
        assert all_gather(output_tensor=gathered, input_tensor=torch.arange(4.0), group=group) is None
        assert torch.equal(gathered, torch.arange(4.0))
        reduced = torch.empty(4)
        reduce_scatter(output_tensor=reduced, input_tensor=torch.ones(4), group=group, op=dist.ReduceOp.SUM)
        assert torch.equal(reduced, torch.ones(4))
    assert wait.seconds > 0
    wait.reset()
    assert wait.seconds == 0.0


def test_slow_rank_fault_is_off_unless_asked_and_checks_its_settings(monkeypatch):
    for name in ("KILN_FAULT_SLOW_RANK", "KILN_FAULT_SLOW_S", "KILN_FAULT_SLOW_FROM_STEP"):
        monkeypatch.delenv(name, raising=False)
    assert SlowRankFault.from_env() is None
    monkeypatch.setenv("KILN_FAULT_SLOW_RANK", "1")
    monkeypatch.setenv("KILN_FAULT_SLOW_FROM_STEP", "7")
    assert SlowRankFault.from_env() == SlowRankFault(rank=1, seconds=0.2, from_step=7)
    monkeypatch.setenv("KILN_FAULT_SLOW_S", "0")
    with pytest.raises(TrainerError, match="KILN_FAULT_SLOW_S"):
        SlowRankFault.from_env()
    monkeypatch.setenv("KILN_FAULT_SLOW_S", "fast")
    with pytest.raises(TrainerError, match="KILN_FAULT_SLOW_RANK"):
        SlowRankFault.from_env()


def test_slow_node_fault_follows_the_node_not_the_rank(monkeypatch):
    for name in ("KILN_FAULT_SLOW_RANK", "KILN_FAULT_SLOW_S", "KILN_FAULT_SLOW_FROM_STEP", "KILN_NODE_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KILN_FAULT_SLOW_NODE", "node2")
    fault = SlowRankFault.from_env()
    assert fault == SlowRankFault(rank=-1, seconds=0.2, from_step=1, node="node2")
    monkeypatch.setenv("KILN_NODE_NAME", "node2")
    assert fault.hits(0) and fault.hits(5)
    monkeypatch.setenv("KILN_NODE_NAME", "node3")
    assert not fault.hits(0) and not fault.hits(1)
    monkeypatch.setenv("KILN_FAULT_SLOW_RANK", "1")
    with pytest.raises(TrainerError, match="not both"):
        SlowRankFault.from_env()


def test_prometheus_textfile_keeps_each_latest_value_and_labels_ranks(tmp_path):
    sink = PrometheusTextfileSink(tmp_path / "m.prom", {"run_dir": "/r"})
    sink.log(10, {"loss": 2.5, "tokens_per_s": 100.0})
    sink.log(15, {"rank_step_times": [0.1, 0.4], "straggler_rank": 1, "scaling_efficiency": 0.25})
    sink.log(16, {"event": "straggler", "rank": 1})  # events are not series
    sink.close()  # written by a thread of its own (test_metrics)
    text = (tmp_path / "m.prom").read_text()
    assert 'kiln_train_loss{run_dir="/r"} 2.5' in text  # from the earlier record, still there
    assert 'kiln_train_straggler_rank{run_dir="/r"} 1.0' in text
    assert 'kiln_train_rank_step_times{run_dir="/r",rank="1"} 0.4' in text
    assert 'kiln_train_step{run_dir="/r"} 15' in text


def _jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "a") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")


def test_watch_alerts_or_excludes_each_node_once_within_the_budget(tmp_path):
    run = tmp_path
    flag = {"event": "straggler", "ratio": 4.0, "message": "straggler: ..."}
    _jsonl(run / "metrics.jsonl", [{"step": 5, "loss": 3.0}, {**flag, "step": 15, "rank": 1, "node": "n2"}])
    alert = StragglerWatch(run_dir=run, policy=StragglerPolicy())
    [action] = alert.poll()
    assert action.kind == "alert" and "policy action: alert" in action.message
    watch = StragglerWatch(run_dir=run, policy=StragglerPolicy(action="exclude_node", max_excluded=1))
    [action] = watch.poll()
    assert (action.kind, action.node) == ("exclude_node", "n2") and "exclude node n2" in action.message
    assert watch.poll() == []  # nothing new
    _jsonl(run / "metrics.jsonl", [{**flag, "step": 40, "rank": 0, "node": "n2"},
                                   {**flag, "step": 60, "rank": 3, "node": "n5"},
                                   {**flag, "step": 80, "rank": 2, "node": ""}])
    again, over_budget, unnamed = watch.poll()
    assert again.kind == "alert" and "already excluded" in again.reason
    assert over_budget.kind == "alert" and "max_excluded=1" in over_budget.reason
    assert unnamed.kind == "alert" and "did not name" in unnamed.reason
    assert watch.excluded == ["n2"]


def test_straggler_events_reads_whole_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"event": "straggler", "step": 5, "rank": 1, "node": "x"}) + "\n" + '{"event": "strag')
    events, offset = straggler_events(path)
    assert [e.rank for e in events] == [1] and offset < path.stat().st_size
    assert straggler_events(tmp_path / "missing.jsonl", 7) == ([], 7)


def test_policy_names_a_bad_exclusion_budget():
    with pytest.raises(ConfigError, match="max_excluded"):
        StragglerPolicy(max_excluded=-1)

"""kiln.signals: textfile parsing, active-run selection, quarantine rate, queue latency, the endpoint.

Pure functions get a happy and a failure path; the promtool rule tests live in
tests/integration/test_prometheus.py (they need the Debian package).
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from kiln import runs, signals
from kiln.errors import ConfigError
from kiln.policy import PRODUCTION, SANDBOX

T0 = 1_800_000_000.0
TRAINER_PROM = (
    'kiln_train_step{run_dir="/x/train"} 40\n'
    'kiln_train_checkpoint_lag_steps{run_dir="/x/train"} 250\n'
    'kiln_train_data_wait_frac{run_dir="/x/train"} 0.25\n'
    'kiln_train_tokens_per_s{run_dir="/x/train"} 1234.5\n'
)


@pytest.fixture
def config(tmp_path: Path) -> signals.SignalsConfig:
    return signals.SignalsConfig(home=tmp_path, stale_after_s=60.0, report_window_s=3600.0)


def _run_dir(config: signals.SignalsConfig, dag: str, run: str) -> Path:
    """The run directory as the pipeline makes it (``kiln.runs``: name, identity record)."""
    return runs.run_dir(runs.run_key(dag, run), config.runs_dir)


def _run(config: signals.SignalsConfig, dag: str, run: str, prom: str = TRAINER_PROM, *, age_s: float = 0.0) -> Path:
    train = _run_dir(config, dag, run) / "train"
    (train / "checkpoints" / "step-00000010").mkdir(parents=True)
    (train / "metrics.prom").write_text(prom)
    os.utime(train / "metrics.prom", (T0 - age_s, T0 - age_s))
    return train


def _series(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of an exposition (labels as written, sorted by the renderer)."""
    rows = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {series: float(value) for series, value in rows}


# ------------------------------------------------------------------------------------- parsing
def test_parse_textfile_reads_trainer_output_and_escaped_labels():
    samples, bad = signals.parse_textfile('# HELP x y\nkiln_a{run_dir="/r",note="say \\"hi\\", ok"} 1.5\nkiln_b 2\n\n')
    assert bad == 0
    assert samples == [
        signals.Sample("kiln_a", (("note", 'say \\"hi\\", ok'), ("run_dir", "/r")), 1.5),
        signals.Sample("kiln_b", (), 2.0),
    ]


def test_parse_textfile_counts_torn_and_malformed_lines_instead_of_failing():
    samples, bad = signals.parse_textfile('kiln_ok 1\nkiln_torn{run_dir="/r\nkiln_nan_word abc\n{x="1"} 3\n')
    assert [s.name for s in samples] == ["kiln_ok"]
    assert bad == 3


def test_config_names_the_bad_field():
    with pytest.raises(ConfigError, match="stale_after_s"):
        signals.SignalsConfig(home=Path("/tmp"), stale_after_s=0)
    with pytest.raises(ConfigError, match="report_window_s"):
        signals.SignalsConfig(home=Path("/tmp"), report_window_s=-1)


def test_config_from_env_rejects_a_non_number(monkeypatch):
    monkeypatch.setenv("KILN_SIGNALS_STALE_AFTER_S", "ten minutes")
    with pytest.raises(ConfigError, match="KILN_SIGNALS_STALE_AFTER_S"):
        signals.SignalsConfig.from_env()


# ------------------------------------------------------------------------------------ training
def test_active_run_is_relabelled_dag_run_with_derived_utilisation(config):
    _run(config, "kiln_sandbox", "manual__1")
    got = _series(signals.render(config, now=T0 + 5))
    labels = '{dag="kiln_sandbox",run="manual__1"}'
    assert got[f"kiln_train_checkpoint_lag_steps{labels}"] == 250
    assert got[f"kiln_train_tokens_per_s{labels}"] == 1234.5
    assert got[f"kiln_train_up{labels}"] == 1
    assert got[f"kiln_train_metrics_age_seconds{labels}"] == 5
    assert got[f"kiln_train_utilisation_ratio{labels}"] == 0.75  # 1 - data wait, no busy/GPU measure
    assert not any("run_dir" in k for k in got), "the trainer's run_dir label is replaced by dag/run"


def test_finished_and_stale_runs_are_not_exported(config):
    done = _run(config, "kiln_sandbox", "done")
    (done / "result.json").write_text("{}")
    _run(config, "kiln_sandbox", "stale", age_s=61)
    _run(config, "kiln_production", "live", age_s=59)
    runs = {k for k in _series(signals.render(config, now=T0)) if k.startswith("kiln_train_up")}
    assert runs == {'kiln_train_up{dag="kiln_production",run="live"}'}


def test_labels_are_the_exact_ids_the_run_directory_records(config):
    for run_id in ("probe:col", "probe_col", "probe+col"):  # one directory, one label each
        _run(config, "kiln_sandbox", run_id)
    up = {k for k in _series(signals.render(config, now=T0)) if k.startswith("kiln_train_up")}
    assert up == {f'kiln_train_up{{dag="kiln_sandbox",run="{r}"}}' for r in ("probe:col", "probe_col", "probe+col")}


def test_a_directory_without_an_identity_record_is_not_a_run_and_a_torn_record_is_counted(config):
    stray = config.runs_dir / "kiln_sandbox" / "manual__1" / "train"  # not made by kiln.runs: no run.json
    stray.mkdir(parents=True)
    (stray / "metrics.prom").write_text(TRAINER_PROM)
    os.utime(stray / "metrics.prom", (T0, T0))
    torn = _run(config, "kiln_sandbox", "torn").parent
    (torn / runs.RUN_RECORD).write_text('{"kind": "kiln.Run", "dag_id": ')
    got = _series(signals.render(config, now=T0))
    assert not any(k.startswith("kiln_train_up") for k in got)
    assert got['kiln_signals_parse_errors{source="training"}'] == 1


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ({"kiln_train_gpu_util": 91.0, "kiln_train_busy_frac": 0.5}, 0.91),  # GPU percent wins
        ({"kiln_train_gpu_util": 0.4}, 0.4),  # already a ratio
        ({"kiln_train_busy_frac": 0.8, "kiln_train_data_wait_frac": 0.0}, 0.8),
        ({"kiln_train_data_wait_frac": 1.2}, 0.0),  # never negative
        ({"kiln_train_loss": 2.0}, None),  # nothing to derive it from: no series rather than a guess
    ],
)
def test_utilisation_prefers_the_most_direct_measure(metrics, expected):
    assert signals.utilisation(metrics) == (pytest.approx(expected) if expected is not None else None)


def test_malformed_trainer_file_is_counted_not_fatal(config):
    _run(config, "kiln_sandbox", "r", prom='kiln_train_step{run_dir="/x"} 3\ngarbage line here\n')
    got = _series(signals.render(config, now=T0))
    assert got['kiln_signals_parse_errors{source="training"}'] == 1
    assert got['kiln_train_step{dag="kiln_sandbox",run="r"}'] == 3


# ---------------------------------------------------------------------------------- quarantine
def _report(config, dag: str, run: str, share: float, *, age_s: float = 0.0, snapshot: str = "abc.dir") -> Path:
    path = _run_dir(config, dag, run) / signals.QUARANTINE_JSON
    path.write_text(json.dumps({"kind": "kiln.QuarantineReport", "shards": 8, "quarantined": ["a"] * int(share * 8),
                                "quarantined_share": share, "snapshot_id": snapshot}))
    os.utime(path, (T0 - age_s, T0 - age_s))
    return path


def test_quarantine_rate_per_snapshot_and_policy_ceilings_from_kiln_policy(config):
    _report(config, "kiln_production", "p1", 0.375)
    _report(config, "kiln_sandbox", "old", 0.9, age_s=3601)
    got = _series(signals.render(config, now=T0))
    assert got['kiln_quarantine_share{dag="kiln_production",run="p1",snapshot="abc.dir"}'] == 0.375
    assert got['kiln_quarantine_quarantined_shards{dag="kiln_production",run="p1",snapshot="abc.dir"}'] == 3
    assert not any('run="old"' in k for k in got), "reports outside the window are history"
    for policy in (PRODUCTION, SANDBOX):
        ceiling = got[f'kiln_policy_max_quarantine_share{{dag="{policy.dag_id}",policy="{policy.name}"}}']
        assert ceiling == policy.max_quarantine_share


def test_unreadable_quarantine_report_is_counted(config):
    path = _report(config, "kiln_sandbox", "s1", 0.1)
    path.write_text("{not json")
    os.utime(path, (T0, T0))
    got = _series(signals.render(config, now=T0))
    assert got['kiln_signals_parse_errors{source="quarantine"}'] == 1
    assert not any(k.startswith("kiln_quarantine_share") for k in got)


def test_report_file_name_matches_validation():
    from kiln.data.validation.report import QUARANTINE_JSON

    assert signals.QUARANTINE_JSON == QUARANTINE_JSON


# ------------------------------------------------------------------------------- queue latency
def _running(task: str, start: float, *, upstream=(), run_after: float | None = T0, try_number=1, map_index=-1,
             run="r1", dag="kiln_sandbox", pool="kiln_sandbox", run_type="manual", clear_number=0) -> dict:
    return {"kind": "running", "dag_id": dag, "run_id": run, "task_id": task, "map_index": map_index,
            "try_number": try_number, "at": start, "start": start, "pool": pool, "upstream": list(upstream),
            "run_type": run_type, "run_after": run_after, "clear_number": clear_number}


def _finished(task: str, end: float, *, run="r1", dag="kiln_sandbox", map_index=-1) -> dict:
    return {"kind": "finished", "dag_id": dag, "run_id": run, "task_id": task, "map_index": map_index,
            "try_number": 1, "at": end, "end": end}


def test_queue_latency_is_ready_to_running():
    events = [
        _running("snapshot", T0 + 3),  # root: ready at run_after (the trigger)
        _finished("snapshot", T0 + 10),
        _running("validate", T0 + 12, upstream=["snapshot"], map_index=0),
        _running("validate", T0 + 70, upstream=["snapshot"], map_index=1),  # waited for a pool slot
        _finished("validate", T0 + 20, map_index=0),
        _finished("validate", T0 + 80, map_index=1),
        _running("gate", T0 + 81, upstream=["validate"]),  # ready when the last mapped index ended
    ]
    got = sorted((q.task_id, q.seconds, q.mapped) for q in signals.queue_latencies(list(reversed(events))).known)
    assert got == [("gate", 1.0, False), ("snapshot", 3.0, False), ("validate", 2.0, True), ("validate", 60.0, True)]


def test_queue_latency_skips_retries_and_cleared_runs_and_counts_unknown_ready_times():
    events = [
        _running("train", T0 + 500, upstream=["gate"]),  # the gate's end was never recorded
        _running("snapshot", T0 + 900, try_number=2),  # retry: ready is a retry delay, not queueing
        _running("snapshot", T0 + 900, run="r2", clear_number=1),  # cleared by a human
    ]
    lat = signals.queue_latencies(events)
    assert lat.known == []
    assert lat.unknown == {("kiln_sandbox", "kiln_sandbox", "manual"): 1}


def test_resumed_deferred_task_keeps_its_first_start():
    events = [_running("approval", T0 + 2), _running("approval", T0 + 3600)]  # resumed after a day of waiting
    assert [q.seconds for q in signals.queue_latencies(events).known] == [2.0]


def _fake_ti(*, start: datetime, run_after: datetime, upstream=("gate",), end: datetime | None = None):
    dag_run = SimpleNamespace(run_type=SimpleNamespace(value="manual"), run_after=run_after, clear_number=0)
    return SimpleNamespace(
        dag_id="kiln_sandbox", run_id="manual__1", task_id="train", map_index=-1, try_number=1,
        start_date=start, end_date=end, task=SimpleNamespace(pool="kiln_sandbox", upstream_task_ids=set(upstream)),
        _ti_context_from_server=SimpleNamespace(dag_run=dag_run),
    )


def test_queue_event_reads_a_runtime_task_instance():
    t = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    ti = _fake_ti(start=t + timedelta(seconds=50), run_after=t, end=t + timedelta(seconds=90))
    running = signals.queue_event("running", ti, now=T0)
    assert running | {"at": 0} == {
        "kind": "running", "dag_id": "kiln_sandbox", "run_id": "manual__1", "task_id": "train", "map_index": -1,
        "try_number": 1, "at": 0, "pool": "kiln_sandbox", "upstream": ["gate"], "start": (t + timedelta(seconds=50)).timestamp(),
        "run_type": "manual", "run_after": t.timestamp(), "clear_number": 0,
    }
    assert signals.queue_event("finished", ti, now=T0)["end"] == (t + timedelta(seconds=90)).timestamp()
    with pytest.raises(ValueError, match="queued"):
        signals.queue_event("queued", ti)


def test_queue_events_file_round_trip_and_histogram(config):
    for e in [_running("snapshot", T0 + 3), _running("snapshot", T0 + 50, run="r2"), _running("snapshot", T0 + 1, run="r3")]:
        signals.append_queue_event(config.queue_events, e)
    with open(config.queue_events, "a") as fh:
        fh.write('{"kind": "running", "dag_id": "torn')  # a task appending right now
    got = _series(signals.render(config, now=T0))
    def bucket(le: str) -> float:
        return got['kiln_airflow_queue_latency_seconds_bucket'
                   f'{{dag="kiln_sandbox",le="{le}",mapped="false",pool="kiln_sandbox",run_type="manual"}}']

    assert [bucket(le) for le in ("1.0", "2.5", "5.0", "45.0", "60.0", "+Inf")] == [1, 1, 2, 2, 3, 3]
    labels = '{dag="kiln_sandbox",mapped="false",pool="kiln_sandbox",run_type="manual"}'
    assert got["kiln_airflow_queue_latency_seconds_count" + labels] == 3
    assert got["kiln_airflow_queue_latency_seconds_sum" + labels] == 54
    assert got['kiln_signals_parse_errors{source="queue"}'] == 1


def test_rules_target_the_policy_dag_ids():
    rules = (Path(__file__).resolve().parents[3] / "docker/prometheus/rules/kiln.rules.yml").read_text()
    assert f'dag="{SANDBOX.dag_id}"' in rules
    assert ") > 45" in rules, "P99 threshold of interactive runs"


# ------------------------------------------------------------------------------------ endpoint
def test_http_endpoint_serves_metrics_and_health(config):
    _run(config, "kiln_sandbox", "live", age_s=-(time.time() - T0))  # written "now"
    server, url = signals.serve_in_thread(config)
    try:
        metrics = requests.get(f"{url}/metrics", timeout=5)
        assert metrics.status_code == 200
        assert metrics.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert 'kiln_train_checkpoint_lag_steps{dag="kiln_sandbox",run="live"} 250.0' in metrics.text
        assert requests.get(f"{url}/healthz", timeout=5).text == "ok\n"
        assert requests.get(f"{url}/nope", timeout=5).status_code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_cli_queue_latency_summary(config, monkeypatch, capsys):
    import argparse

    from kiln.cli import signals as cli

    monkeypatch.setenv("KILN_HOME", str(config.home))
    for i, wait in enumerate([1, 2, 3, 100]):
        signals.append_queue_event(config.queue_events, _running("snapshot", T0 + wait, run=f"r{i}"))
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["signals", "queue-latency"])
    assert args.func(args) == 0
    (row,) = json.loads(capsys.readouterr().out)["groups"]
    assert row | {} == {"dag": "kiln_sandbox", "pool": "kiln_sandbox", "run_type": "manual", "count": 4,
                        "p50_s": 2.0, "p99_s": 100.0, "max_s": 100.0, "unknown": 0}


# ------------------------------------------------------------------------------------- runbook
REPO = Path(__file__).resolve().parents[3]


def test_every_alert_has_a_runbook_entry_and_links_to_it():
    import yaml

    runbook = (REPO / "docs/runbook.md").read_text()
    rules = yaml.safe_load((REPO / "docker/prometheus/rules/kiln.rules.yml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 7
    for rule in alerts:
        name = rule["alert"]
        assert f"\n## {name}\n" in runbook, f"docs/runbook.md has no entry for {name}"
        assert rule["annotations"]["runbook"] == f"docs/runbook.md#{name.lower()}"


def test_runbook_cites_only_tests_that_exist():
    """``path::test_name`` (or ``::test_name`` after a path) in the runbook names a real test function."""
    runbook = (REPO / "docs/runbook.md").read_text()
    cited, path = [], None
    for m in re.finditer(r"`(tests/[\w/]+\.py)?::(\w+)`", runbook):
        path = m.group(1) or path
        cited.append((path, m.group(2)))
    assert len(cited) >= 15
    for path, name in cited:
        source = (REPO / path).read_text()
        name = name if name.startswith("test_") else None
        if name:
            assert re.search(rf"^def {name}\(", source, re.M), f"runbook cites {path}::{name}, which does not exist"


# ------------------------------------------------------------------------------------ run view
def test_run_view_reads_the_run_directory_of_a_real_run_id(config):
    run = _run_dir(config, "kiln_production", "scheduled__2026-11-30T03:00:00+00:00")
    (run / "train").mkdir(parents=True)
    (run / signals.QUARANTINE_JSON).write_text(json.dumps({"quarantined_share": 0.5, "snapshot_id": "s.dir", "gate": "fail"}))
    (run / "train" / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 1, "event": "rollback"}\n{"torn')
    view = signals.run_view(config, "kiln_production", "scheduled__2026-11-30T03:00:00+00:00")
    assert view["quarantine"]["share"] == 0.5 and view["quarantine"]["gate"] == "fail" and view["quarantine"]["html"] is None
    assert view["training"]["last"] == {"step": 1, "loss": 3.0}, "events and torn lines are skipped"
    assert view["training"]["finished"] is False


def test_run_directory_never_leaves_the_runs_directory(config):
    with pytest.raises(ConfigError, match="does not name a run directory"):
        signals.run_directory(config, "..", "..")


def test_mlflow_run_url_found_by_run_key_and_none_on_any_failure(monkeypatch):
    import requests as real_requests

    calls = []

    class Resp:
        def __init__(self, status, body):
            self.status_code, self._body = status, body

        def json(self):
            return self._body

    def get(url, params, timeout, auth=None):
        calls.append(("get", params["experiment_name"]))
        return Resp(200, {"experiment": {"experiment_id": "7"}})

    def post(url, timeout, json, auth=None):
        calls.append(("post", json["filter"]))
        return Resp(200, {"runs": [{"info": {"run_id": "abc"}}]})

    monkeypatch.setattr(real_requests, "get", get)
    monkeypatch.setattr(real_requests, "post", post)
    assert signals.mlflow_run_url("http://m:5000/", "kiln_sandbox", "manual__1") == "http://m:5000/#/experiments/7/runs/abc"
    assert calls == [("get", "kiln-sandbox"), ("post", "tags.`kiln.run_key` = 'kiln_sandbox/manual__1'")]
    assert signals.mlflow_run_url("http://m:5000", "not_a_kiln_dag", "r") is None

    def refused(*args, **kwargs):
        raise real_requests.ConnectionError("refused")

    monkeypatch.setattr(real_requests, "get", refused)
    assert signals.mlflow_run_url("http://m:5000", "kiln_sandbox", "manual__1") is None

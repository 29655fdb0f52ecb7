"""Corpus announcements under a real scheduler: ``kiln snapshot create --announce`` posts the corpus
Asset event and the production DAG runs on exactly the announced bytes; an announcement whose id is
not what the run finds fails the run at its snapshot task, once, without retry and without training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]


def _asset_runs(admin, dag_id: str) -> dict[str, dict]:
    runs = admin.request("GET", f"/dags/{dag_id}/dagRuns", params={"limit": 100})["dag_runs"]
    return {r["dag_run_id"]: r for r in runs if r.get("run_type") == "asset_triggered"}


def _new_asset_run(admin, dag_id: str, known: set[str], timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = [r for rid, r in _asset_runs(admin, dag_id).items() if rid not in known]
        if fresh:
            assert len(fresh) == 1, f"one announcement started {len(fresh)} runs"
            return fresh[0]
        time.sleep(2)
    raise AssertionError(f"no asset-triggered run of {dag_id} within {timeout:.0f}s of the announcement")


def _task(admin, dag_id: str, run_id: str, task_id: str, states: tuple[str, ...], timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ti in admin.task_instances(dag_id, run_id):
            if ti["task_id"] == task_id and ti.get("state") in states:
                return ti
        time.sleep(2)
    raise AssertionError(f"{dag_id}/{run_id}/{task_id} did not reach {states} within {timeout:.0f}s")


def _end_run(admin, dag_id: str, run_id: str) -> None:
    """Stop a production run the test no longer needs (production runs one at a time). The embedded
    stack's SQLite can answer a write with HTTP 500 ("database is locked", while the scheduler writes):
    the PATCH is sent again then, or the run left behind blocks every later production run."""
    from kiln.errors import AirflowAPIError

    for attempt in range(5):
        try:
            admin.request("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed"})
            break
        except AirflowAPIError as exc:
            if exc.status is None or exc.status < 500 or attempt == 4:
                raise
            time.sleep(2)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not any(ti.get("state") in ("running", "queued", "scheduled", "deferred", "awaiting_input", "restarting")
                   for ti in admin.task_instances(dag_id, run_id)):
            return
        time.sleep(2)


def test_announced_snapshot_starts_production_on_those_bytes(stack, admin):
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import PRODUCTION

    s = kiln_settings.load()
    corpus = s.corpus_root / PRODUCTION.corpus
    build_corpus(corpus, shards=8, seed=11, poison=("null_text", "zero_bytes"))
    admin.wait_for_dag(PRODUCTION.dag_id)
    admin.unpause(PRODUCTION.dag_id)
    known = set(_asset_runs(admin, PRODUCTION.dag_id))

    kiln = Path(sys.executable).with_name("kiln")
    done = subprocess.run([str(kiln), "snapshot", "create", str(corpus), "--announce"], env=dict(os.environ),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["announced"]["event_id"], printed

    run = _new_asset_run(admin, PRODUCTION.dag_id, known)
    run_id = run["dag_run_id"]
    try:
        _task(admin, PRODUCTION.dag_id, run_id, "snapshot", ("success",))
        pinned = admin.xcom(PRODUCTION.dag_id, run_id, "snapshot")
        assert pinned["id"] == printed["id"] and pinned["dvc"] == printed["dvc"]
        assert pinned["corpus"] == PRODUCTION.corpus
    finally:
        _end_run(admin, PRODUCTION.dag_id, run_id)


def test_announcement_of_other_bytes_fails_the_run_once_before_training(stack, admin):
    from kiln import settings as kiln_settings
    from kiln.cli.snapshot import announce_snapshot
    from kiln.data.corpus import build_corpus
    from kiln.policy import PRODUCTION

    s = kiln_settings.load()
    build_corpus(s.corpus_root / PRODUCTION.corpus, shards=8, seed=11, poison=("null_text", "zero_bytes"))
    admin.wait_for_dag(PRODUCTION.dag_id)
    admin.unpause(PRODUCTION.dag_id)
    known = set(_asset_runs(admin, PRODUCTION.dag_id))
    stale = "0" * 32 + ".dir"  # an announcement of bytes the corpus no longer holds
    announce_snapshot(admin, {"id": stale, "corpus": PRODUCTION.corpus})

    run_id = _new_asset_run(admin, PRODUCTION.dag_id, known)["dag_run_id"]
    ti = _task(admin, PRODUCTION.dag_id, run_id, "snapshot", ("failed", "up_for_retry"))
    assert ti["state"] == "failed" and int(ti["try_number"]) == 1, "a snapshot mismatch must not be retried"
    log = admin.task_log(PRODUCTION.dag_id, run_id, "snapshot", try_number=1)
    assert "SnapshotMismatchError" in log and stale in log and "refusing to train on other bytes" in log
    deadline = time.monotonic() + 120
    while admin.get_run(PRODUCTION.dag_id, run_id)["state"] not in ("failed", "success"):
        assert time.monotonic() < deadline, "the run did not end after its snapshot failed"
        time.sleep(2)
    assert admin.get_run(PRODUCTION.dag_id, run_id)["state"] == "failed"
    states = {t["task_id"]: t.get("state") for t in admin.task_instances(PRODUCTION.dag_id, run_id)}
    assert states["train"] in ("upstream_failed", None, "none"), states

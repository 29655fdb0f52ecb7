"""No priority inversion under the real scheduler: a production run queued *after* several sandbox
runs starts before the sandbox runs that are still waiting.

Why it holds: every task of a policy runs in that policy's pool (``kiln.policy``: production in a
reserved pool, sandbox capped by its own) with the policy's priority weight (production 100, sandbox
1), so sandbox work can fill only the sandbox pool and never the slots production needs, and where
both compete for the executor the scheduler takes the higher weight first.

How it is shown cheaply: each run carries a conf key the DAG's form does not define, so its first
task (``snapshot``) starts, refuses the conf (``check_run_conf``, no retry) and the run fails at
once; only when those first tasks are *queued* and start matters here. Both DAGs are paused while
the runs are queued; sandbox is unpaused first, so its runs have the head start. The check: no
sandbox task was queued between the moment production's became ready (``scheduled_when``) and its
own queuing (``queued_when``), and production's started before the last sandbox run's.
"""

from __future__ import annotations

import time
from datetime import datetime

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]

SANDBOX_RUNS = 4
PROBE = "priority_probe"  # not a param of either DAG: the snapshot task refuses it and the run ends


def _active_runs(admin, dag_id: str) -> list[dict]:
    runs = admin.request("GET", f"/dags/{dag_id}/dagRuns", params={"state": ["queued", "running"], "limit": 100})
    return runs["dag_runs"]


def _pause(admin, dag_id: str, paused: bool) -> None:
    admin.request("PATCH", f"/dags/{dag_id}", json={"is_paused": paused})


def _when(stamp: str | None) -> datetime:
    """An API timestamp (ISO 8601, ``Z``), compared as a time: the API drops zero microseconds."""
    assert stamp, "the task instance lacks this timestamp"
    return datetime.fromisoformat(stamp)


def _first_task(admin, dag_id: str, run_id: str) -> dict | None:
    return next((ti for ti in admin.task_instances(dag_id, run_id) if ti["task_id"] == "snapshot"), None)


def test_queued_production_run_starts_before_queued_sandbox_runs(stack, admin):
    from kiln.policy import PRODUCTION, SANDBOX
    from kiln.stack.embedded import POOL_SLOTS

    # The premise: sandbox can run fewer tasks at once than there are queued sandbox runs.
    assert POOL_SLOTS[SANDBOX.pool] < SANDBOX_RUNS - 1
    assert PRODUCTION.pool != SANDBOX.pool and PRODUCTION.priority_weight > SANDBOX.priority_weight
    for dag_id in (SANDBOX.dag_id, PRODUCTION.dag_id):
        admin.wait_for_dag(dag_id)
    deadline = time.monotonic() + 300  # production allows one active run: let an earlier test's end
    while _active_runs(admin, PRODUCTION.dag_id) or _active_runs(admin, SANDBOX.dag_id):
        assert time.monotonic() < deadline, "runs of an earlier test are still active"
        time.sleep(3)

    _pause(admin, SANDBOX.dag_id, True)
    _pause(admin, PRODUCTION.dag_id, True)
    try:
        sandbox = [admin.trigger(SANDBOX.dag_id, conf={PROBE: i})["dag_run_id"] for i in range(SANDBOX_RUNS)]
        production = admin.trigger(PRODUCTION.dag_id, conf={PROBE: 0})["dag_run_id"]
        _pause(admin, SANDBOX.dag_id, False)  # sandbox first: the queued sandbox runs get a head start
        _pause(admin, PRODUCTION.dag_id, False)

        runs = [(SANDBOX.dag_id, r) for r in sandbox] + [(PRODUCTION.dag_id, production)]
        deadline = time.monotonic() + 480  # safety net, not a timing assertion
        while not all(admin.get_run(d, r)["state"] in ("success", "failed") for d, r in runs):
            assert time.monotonic() < deadline, {r: admin.get_run(d, r)["state"] for d, r in runs}
            time.sleep(3)
    finally:
        _pause(admin, SANDBOX.dag_id, False)
        _pause(admin, PRODUCTION.dag_id, False)

    firsts = {r: _first_task(admin, d, r) for d, r in runs}
    for run_id, ti in firsts.items():  # every run got as far as its first task, which refused the probe
        assert ti is not None and ti["state"] == "failed" and ti["start_date"], (run_id, ti)
    assert all(admin.get_run(d, r)["state"] == "failed" for d, r in runs)
    prod_ti = firsts[production]
    assert prod_ti["priority_weight"] > max(firsts[r]["priority_weight"] for r in sandbox)
    # From the moment production's task could run (scheduled), no sandbox task was queued ahead of it:
    # the scheduler's pick, not the executor's start order, is what priority decides. Sandbox tasks
    # queued before that moment are the head start (their probe fails in about a second and frees its
    # slot, so on a loaded host more than the pool's slots of them may start before production's run
    # is even created).
    ready, queued = _when(prod_ti["scheduled_when"]), _when(prod_ti["queued_when"])
    assert ready <= queued, prod_ti
    timeline = {r: (firsts[r]["queued_when"], firsts[r]["start_date"]) for r in sandbox}
    jumped = [r for r in sandbox if ready <= _when(firsts[r]["queued_when"]) < queued]
    assert not jumped, (prod_ti["scheduled_when"], prod_ti["queued_when"], timeline)
    # And production did not wait for the sandbox's backlog: some sandbox run was still waiting.
    sandbox_starts = sorted(_when(firsts[r]["start_date"]) for r in sandbox)
    assert _when(prod_ti["start_date"]) < sandbox_starts[-1], (prod_ti["start_date"], timeline)
    log = admin.task_log(PRODUCTION.dag_id, production, "snapshot", try_number=1)
    assert PROBE in log, log[-2000:]  # it failed for the probe, not for something else

"""The Airflow scheduler killed mid-run and restarted (``scheduler``).

A real embedded stack (``kiln.stack.embedded``: scheduler, dag-processor, triggerer, api-server, MLflow)
under the run's throwaway KILN_HOME on free ports. Each trial triggers the sandbox DAG over REST on
a small corpus with one seeded poison, waits until a seeded stage has started, and SIGKILLs either
the scheduler process alone or its whole process group (the LocalExecutor's workers and the tasks
they run go with it, as when the scheduler's host dies). After a short outage ``stack.up()``
starts a new scheduler. The DAG run must end — success, or failed with the failed task named —
within the limit, and no stage may have run twice with a visible effect: one MLflow run and at most
one model version per run key, the poisoned shard never in the manifest.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from kiln.runs import RUN_KEY_TAG, experiment_name, run_key_filter
from kiln.settings import restore_environ
from kiln.util.net import free_port
from kiln_devtools.chaos.core import Context, Family, Outcome, TrialResult, outcome_line, total, trial_rng

STAGES = ("snapshot", "validate_shards", "data_gate", "train", "evaluate", "register_candidate", "promote")
STARTED = frozenset({"running", "deferred", "success", "failed", "up_for_retry", "skipped", "up_for_reschedule"})
RUN_LIMIT_S = 1200.0
"""A safety net: a run that has not ended by then counts as stuck (lost), not as slow."""
STACK_ENV = {
    # After a whole-group kill the orphaned task instances are found by their missing heartbeat;
    # the default (300 s) would make each such trial wait five minutes for nothing.
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "60",
}


class _Patient:
    """The admin client, retrying a call that times out or finds the api-server busy: on a loaded
    2-core machine its one worker sometimes answers after the client's 30 s, which says nothing
    about the scheduler under test."""

    def __init__(self, inner: Any, limit_s: float = 180.0) -> None:
        self._inner, self._limit_s = inner, limit_s

    def __getattr__(self, name: str) -> Any:
        import requests

        from kiln.errors import AirflowAPIError

        attr = getattr(self._inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            deadline = time.monotonic() + self._limit_s
            while True:
                try:
                    return attr(*args, **kwargs)
                except (requests.RequestException, AirflowAPIError) as exc:
                    status = getattr(exc, "status", None)
                    if (status is not None and status < 500) or time.monotonic() > deadline:
                        raise
                    time.sleep(2)

        return call


def plan_scheduler(seed: int, index: int) -> dict[str, Any]:
    rng = trial_rng(seed, "scheduler", index)
    from kiln.data.corpus import POISON_KINDS

    return {"stage": rng.choice(STAGES), "group": index % 2 == 1, "outage_s": rng.choice((2, 5, 10)),
            "poison": rng.choice(sorted(k for k in POISON_KINDS if k != "duplicate_ids_across_shards")),
            "corpus_seed": rng.randrange(10**6)}


def _task_states(admin: Any, dag_id: str, run_id: str) -> dict[str, tuple[str, int]]:
    """task id → (state of its latest try, highest try number) — mapped tasks folded together."""
    states: dict[str, tuple[str, int]] = {}
    for ti in admin.task_instances(dag_id, run_id):
        state, tries = ti.get("state") or "none", int(ti.get("try_number") or 0)
        old = states.get(ti["task_id"])
        states[ti["task_id"]] = (state if old is None or old[0] in STARTED else old[0], max(tries, old[1] if old else 0))
    return states


def scheduler_trial(ctx: Context, index: int, admin: Any) -> TrialResult:
    import mlflow

    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import SANDBOX
    from kiln.runs import run_key
    from kiln.stack import embedded as kiln_stack

    plan = plan_scheduler(ctx.seed, index)
    s = kiln_settings.load()
    built = build_corpus(s.corpus_root / SANDBOX.corpus, shards=4, seed=plan["corpus_seed"], poison=(plan["poison"],))
    poisoned = {Path(p).name for p in built["poisoned"]}
    from kiln.errors import AirflowAPIError

    # A run id of our own: a trigger retried after a timeout gets 409, never a second run.
    run_id, dag_id = f"chaos__{ctx.seed}_{index}_{int(time.time())}", SANDBOX.dag_id
    try:
        admin.trigger(dag_id, conf={"recipe": "tiny.toml", "max_steps": 20, "seed": 5}, run_id=run_id)
    except AirflowAPIError as exc:
        if exc.status != 409:
            raise
    what = "scheduler process group (executor workers and running tasks too)" if plan["group"] else "scheduler process"
    fault = f"SIGKILL {what} once '{plan['stage']}' started; restarted after {plan['outage_s']} s"
    facts: dict[str, Any] = {"stage": plan["stage"], "group": plan["group"]}
    losses: list[str] = []
    deadline = time.monotonic() + RUN_LIMIT_S
    state_at_kill = ""
    while time.monotonic() < deadline:
        states = _task_states(admin, dag_id, run_id)
        if states.get(plan["stage"], ("none", 0))[0] in STARTED:
            state_at_kill = states[plan["stage"]][0]
            break
        if admin.get_run(dag_id, run_id)["state"] in ("success", "failed"):
            break
        time.sleep(0.5)
    pid = kiln_stack.running_pid(s, "scheduler")
    if not state_at_kill or pid is None:
        return TrialResult(family="scheduler", index=index, seed=ctx.seed, outcome="error", fault=fault, facts=facts,
                           detail=f"the stage never started (run {admin.get_run(dag_id, run_id)['state']}, scheduler pid {pid})")
    if plan["group"]:
        os.killpg(pid, signal.SIGKILL)  # started with start_new_session: its pid is the group id
    else:
        os.kill(pid, signal.SIGKILL)
    facts["state_at_kill"] = state_at_kill
    time.sleep(plan["outage_s"])
    kiln_stack.up(timeout=300, quiet=True)
    final = "running"
    while time.monotonic() < deadline:
        final = admin.get_run(dag_id, run_id)["state"]
        if final in ("success", "failed"):
            break
        time.sleep(3)
    states = _task_states(admin, dag_id, run_id)
    facts["dag_state"] = final
    facts["retried_tasks"] = sorted(t for t, (_, tries) in states.items() if tries > 1)
    if final not in ("success", "failed"):
        losses.append(f"the DAG run is still {final} {RUN_LIMIT_S:.0f} s after the trigger: {states}")
    elif final == "failed":
        failed = sorted(t for t, (st, _) in states.items() if st in ("failed", "upstream_failed"))
        facts["failed_tasks"] = failed
        if not failed:
            losses.append("the DAG run failed without a failed task to say why")
    key = run_key(dag_id, run_id)
    client = mlflow.MlflowClient(tracking_uri=s.mlflow_uri)
    experiment = client.get_experiment_by_name(experiment_name(SANDBOX))
    runs = [] if experiment is None else client.search_runs(
        [experiment.experiment_id], filter_string=run_key_filter(key))
    try:
        versions = [mv for mv in client.search_model_versions(f"name = '{SANDBOX.candidate_model}'")
                    if mv.tags.get(RUN_KEY_TAG) == key]
    except Exception:
        versions = []
    facts["mlflow_runs"], facts["model_versions"] = len(runs), len(versions)
    facts["duplicate_effects"] = max(0, len(runs) - 1) + max(0, len(versions) - 1)
    if len(runs) > 1 or len(versions) > 1:
        losses.append(f"a stage ran twice with a visible effect: {len(runs)} MLflow runs, {len(versions)} versions for {key}")
    if final == "success" and len(versions) != 1:
        losses.append(f"the run succeeded with {len(versions)} model versions for {key} (want 1)")
    if final == "success":
        gate = admin.xcom(dag_id, run_id, "data_gate")
        import json

        manifest = json.loads(Path(gate["manifest"]).read_text())
        trained = {Path(sh["path"]).name for sh in manifest["shards"]} & poisoned
        facts["poisoned_in_manifest"] = len(trained)
        if trained:
            losses.append(f"poisoned shard(s) in the TrainingManifest: {sorted(trained)}")
    outcome: Outcome = "lost" if losses else "recovered"
    return TrialResult(family="scheduler", index=index, seed=ctx.seed, outcome=outcome, fault=fault, facts=facts,
                       losses=losses)


def run_scheduler(ctx: Context, indices: list[int]) -> list[TrialResult]:
    from kiln.policy import SANDBOX
    from kiln.stack import embedded as kiln_stack
    from kiln.stack.airflow_client import AirflowClient

    keys = ("KILN_HOME", "KILN_AIRFLOW_PORT", "KILN_MLFLOW_PORT", "KILN_SIGNALS_PORT", "MLFLOW_TRACKING_URI", *STACK_ENV)
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({"KILN_HOME": str(ctx.work / "stack" / "kiln"), "KILN_AIRFLOW_PORT": str(free_port()),
                       "KILN_MLFLOW_PORT": str(free_port()), "KILN_SIGNALS_PORT": str(free_port()), **STACK_ENV})
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    results = []
    try:
        started = time.monotonic()
        info = kiln_stack.up(timeout=300, quiet=True)
        os.environ["MLFLOW_TRACKING_URI"] = info["mlflow"]
        admin = _Patient(AirflowClient(info["airflow"], "admin", kiln_stack.passwords()["admin"]))
        admin.wait_for_dag(SANDBOX.dag_id, timeout=300)
        admin.unpause(SANDBOX.dag_id)
        ctx.log(f"  scheduler: stack up in {time.monotonic() - started:.0f}s")
        for index in indices:
            started = time.monotonic()
            try:
                result = scheduler_trial(ctx, index, admin)
            except Exception as exc:
                result = TrialResult(family="scheduler", index=index, seed=ctx.seed, outcome="error",
                                     fault=str(plan_scheduler(ctx.seed, index)), detail=f"{type(exc).__name__}: {exc}")
            result.seconds = round(time.monotonic() - started, 1)
            results.append(result)
            ctx.log(f"  {result.name:<12} {result.outcome:<9} {result.fault} -> {result.facts.get('dag_state')}"
                    f"  ({result.seconds:.0f}s)")
    finally:
        try:
            kiln_stack.down()
        finally:
            restore_environ(saved)
    return results


def summarize_scheduler(results: list[TrialResult]) -> list[str]:
    states = [r.facts.get("dag_state") for r in results]
    retried = sorted({t for r in results for t in r.facts.get("retried_tasks", [])})
    return [
        outcome_line(results),
        f"DAG runs that completed: {states.count('success')}; failed with the failed task named: "
        f"{sum(bool(r.facts.get('failed_tasks')) for r in results)}; stuck: "
        f"{sum(s not in ('success', 'failed') for s in states if s is not None)}",
        f"stages run twice with a visible effect (extra MLflow runs or model versions per run key): "
        f"{total(results, 'duplicate_effects')} (goal 0); tasks that took another try: {retried or 'none'}",
    ]


SCHEDULER = Family(name="scheduler", title="The Airflow scheduler killed mid-run and restarted",
                   goals="the DAG run completes or fails clearly; no stage runs twice with a visible effect",
                   default_trials=2, run=run_scheduler, summarize=summarize_scheduler)

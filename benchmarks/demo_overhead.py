"""Where the demo's wall time goes: orchestration overhead versus stage work.

Baseline (measured in the same run): the production pipeline's stages called back to back in one
Python process — snapshot, every shard's validation, data gate, tokenizer, every batch's packing,
the token manifest, torchrun training, evaluation, registration, gate, promotion — the work itself
with no orchestrator.
Measured: the same production DAG run through the real embedded Airflow (scheduler, LocalExecutor,
mapped tasks, XCom), triggered and approved over the REST API as ``make demo`` does; the time the
run spends waiting for the (instant) approval is reported apart.

Prints ``ratio = airflow wall / in-process wall`` and per-stage figures; ``run.py`` writes them to
docs/benchmarks.md. Uses its own state folder (``.kiln/bench``) and ports, so it never touches the
demo's stack.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kiln.util.net import free_port

REPO = Path(__file__).resolve().parents[1]


def _in_process(policy, key: str) -> dict[str, float]:
    """Every stage of one run, called directly: the baseline of pure stage work."""
    from kiln import stages

    t: dict[str, float] = {}

    def timed(name, fn, *args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        t[name] = t.get(name, 0.0) + time.perf_counter() - start
        return out

    snap = timed("snapshot", stages.snapshot_stage, policy)
    reports = [timed("validate_shards (all)", stages.validate_stage, policy, snap, batch, key)
               for batch in stages.shard_batches(policy, snap)]
    gated = timed("data_gate", stages.data_gate_stage, policy, snap, reports, key)
    tokenizer = timed("tokenizer", stages.tokenizer_stage, policy, gated, {}, key)
    for parts in stages.token_parts(policy, gated):
        timed("tokenize (all)", stages.tokenize_stage, policy, gated, tokenizer, parts, {}, key)
    data = timed("tokens", stages.tokens_stage, policy, gated, tokenizer, {}, key)
    train = timed("train", stages.train_stage, policy, snap, data, {}, key, log_line=lambda _line: None)
    evaluation = timed("evaluate", stages.evaluate_stage, train, data, key)
    candidate = timed("register_candidate", stages.register_stage, policy, snap, data, train, evaluation, key,
                      {})
    decision = timed("model_gate", stages.model_gate_stage, candidate)
    if decision.action == "promote":
        import datetime as dt

        from kiln.refs import ApprovalAnswer

        # The approval task's part: record an (instant) answer of one of the policy's reviewers.
        reviewer = policy.reviewers[0]
        answer = ApprovalAnswer(chosen_options=["Approve"], responded_by_user={"id": reviewer, "name": reviewer},
                                responded_at=dt.datetime.now(dt.UTC).isoformat())
        timed("approval (recorded)", stages.review_stage, policy, candidate, answer, key)
        timed("promote", stages.promote_stage, policy, candidate, decision, key)
    return t


def _through_airflow(policy) -> tuple[float, float, dict[str, float]]:
    from kiln import settings as kiln_settings
    from kiln.stack import embedded
    from kiln.stack.airflow_client import AirflowClient
    from kiln.stack.demo import DEMO_REVIEWER, follow_run

    s = kiln_settings.load()
    pw = embedded.passwords(s)
    admin = AirflowClient(s.airflow_url, "admin", pw["admin"])
    reviewer = AirflowClient(s.airflow_url, DEMO_REVIEWER, pw[DEMO_REVIEWER])
    admin.wait_for_dag(policy.dag_id)
    admin.unpause(policy.dag_id)
    asked: dict[str, float] = {}

    def approve(ti: dict[str, Any]) -> None:
        if ti["task_id"] == "approval":
            asked["at"] = time.perf_counter()
            reviewer.answer_hitl(policy.dag_id, run_id, "approval", ["Approve"])
            asked["answered"] = time.perf_counter()

    start = time.perf_counter()
    run_id = admin.trigger(policy.dag_id, conf={"reason": "benchmark"})["dag_run_id"]
    final = follow_run(admin, policy.dag_id, run_id, on_awaiting_input=approve, progress=lambda _m: None)
    wall = time.perf_counter() - start
    if final["state"] != "success":
        raise SystemExit(f"benchmark run ended {final['state']}")
    durations: dict[str, float] = {}
    for ti in admin.task_instances(policy.dag_id, run_id):
        name = ti["task_id"] if ti.get("map_index", -1) < 0 else f"{ti['task_id']} (all)"
        durations[name] = durations.get(name, 0.0) + float(ti.get("duration") or 0.0)
    # Polling granularity is 2 s: the approval is answered on the first poll that sees it waiting.
    approval_wait = durations.get("approval", 0.0)
    return wall, approval_wait, durations


def main() -> dict[str, Any]:
    os.environ["KILN_HOME"] = str(REPO / ".kiln" / "bench")
    os.environ["KILN_AIRFLOW_PORT"] = str(free_port())
    os.environ["KILN_MLFLOW_PORT"] = str(free_port())
    os.environ["KILN_SIGNALS_PORT"] = str(free_port())
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    from kiln import settings as kiln_settings
    from kiln.policy import PRODUCTION
    from kiln.stack import embedded
    from kiln.stack.demo import build_demo_corpus

    build_demo_corpus()
    info = embedded.up(quiet=True)
    os.environ["MLFLOW_TRACKING_URI"] = info["mlflow"]
    try:
        direct = _in_process(PRODUCTION, f"benchmark/in-process-{int(time.time())}")
        direct_wall = sum(direct.values())
        wall, approval_wait, durations = _through_airflow(PRODUCTION)
    finally:
        embedded.down()
    orchestrated = wall - approval_wait
    result = {
        "name": "demo: orchestration overhead vs stage work (production DAG, 8 shards, small recipe, 2 nodes)",
        "baseline": "same stages called back to back in one process",
        "in_process_s": round(direct_wall, 1),
        "airflow_wall_s": round(wall, 1),
        "approval_wait_s": round(approval_wait, 1),
        "overhead_s": round(orchestrated - direct_wall, 1),
        "ratio": round(orchestrated / direct_wall, 2),
        "stages_in_process_s": {k: round(v, 1) for k, v in direct.items()},
        "task_durations_airflow_s": {k: round(v, 1) for k, v in sorted(durations.items())},
        "state": str(kiln_settings.load().home),
    }
    print(f"in-process stage work : {result['in_process_s']:.1f} s  (baseline)")
    print(f"through Airflow       : {result['airflow_wall_s']:.1f} s"
          f"  (of which waiting for the approval answer {approval_wait:.1f} s)")
    print(f"orchestration overhead: {result['overhead_s']:.1f} s")
    print(f"ratio (Airflow minus approval wait / in-process): {result['ratio']:.2f}x")
    return result


if __name__ == "__main__":
    main()

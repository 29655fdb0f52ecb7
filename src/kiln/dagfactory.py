"""The one Airflow adapter in kiln: builds a DAG from a Policy. Wiring only.

    snapshot ─► shard_plan ─► validate_shards (mapped over batches) ─► data_gate ─► train ─► evaluate ─► register_candidate
        ─► model_gate ─► [approval (HITL), when the policy requires it] ─► promote ─► outcome

Every task body resolves its inputs, calls one ``kiln.pipeline`` stage and returns a small
JSON-safe reference. Heavy libraries are imported inside the stages, never at parse time. A kiln
fault that a retry cannot fix (``KilnError.retryable is False``: data gate breach, policy violation,
tampered manifest) fails the task without retry.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable, Param, dag, get_current_context, task

from kiln.policy import RECIPES_DIR, Policy

log = logging.getLogger("kiln.dag")

def corpus_asset(corpus: str) -> Asset:
    """The Asset a corpus snapshot producer emits; ``extra`` carries ``{"snapshot_id": "<md5>.dir"}``."""
    return Asset(name=f"kiln.corpus.{corpus}", uri=f"kiln-corpus://{corpus}", group="kiln-corpus")


def _recipe_choices(policy: Policy) -> list[str]:
    return sorted(str(p.relative_to(RECIPES_DIR)) for p in policy.recipes_dir.rglob("*.toml"))


def _params(policy: Policy) -> dict[str, Param]:
    if policy.pinned_inputs:
        # Production inputs are pinned: the registered corpus and the production recipe. Only a
        # free-text reason may be given, for the audit trail.
        return {
            "reason": Param("", type="string", maxLength=200, title="Reason",
                            description="Why this run was started (kept in the audit trail)."),
        }
    return {
        "recipe": Param(policy.default_recipe, type="string", enum=_recipe_choices(policy), title="Recipe",
                        description="Training recipe under training/recipes/."),
        "nodes": Param(policy.nodes, type="integer", minimum=1, maximum=2, title="Nodes",
                       description="torchrun agents forming one job (1 process each on the local launcher)."),
        "max_steps": Param(None, type=["null", "integer"], minimum=1, maximum=5000, title="Max steps",
                           description="Override the recipe's step count (empty = recipe default)."),
        "seed": Param(1337, type="integer", minimum=0, maximum=2**31 - 1, title="Seed"),
        "corpus": Param(policy.corpus, type="string", pattern="^[a-z0-9][a-z0-9_.-]{0,63}$", title="Corpus",
                        description="Corpus name under the DVC workspace's corpora/ folder."),
    }


def _run(stage, *args: Any, **kwargs: Any) -> Any:
    """Call one pipeline stage; a non-retryable kiln error fails the task without retry."""
    from airflow.sdk.exceptions import AirflowFailException

    from kiln.errors import KilnError

    try:
        return stage(*args, **kwargs)
    except KilnError as exc:
        if not exc.retryable:
            raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc
        raise


def _key() -> str:
    ctx = get_current_context()
    return f"{ctx['dag'].dag_id}/{ctx['run_id']}"


APPROVAL_BODY = """\
### Promote `{{ ti.xcom_pull(task_ids='register_candidate')['model_name'] }}` version {{ ti.xcom_pull(task_ids='register_candidate')['version'] }} to `{policy.target_model}@{policy.alias}`?

**Decision:** {{ ti.xcom_pull(task_ids='model_gate')['action'] }} — {{ ti.xcom_pull(task_ids='model_gate')['reasons'] | join('; ') }}

| | candidate | champion |
|---|---|---|
| bits per byte (held-out) | {{ ti.xcom_pull(task_ids='model_gate')['candidate_bits_per_byte'] }} | {{ ti.xcom_pull(task_ids='model_gate')['champion_bits_per_byte'] }} |

**Lineage:** snapshot `{{ ti.xcom_pull(task_ids='snapshot')['id'] }}`, training manifest
`{{ ti.xcom_pull(task_ids='data_gate')['manifest_sha256'][:16] }}`, contract `{{ ti.xcom_pull(task_ids='data_gate')['contract'] }}`,
{{ ti.xcom_pull(task_ids='data_gate')['quarantined'] | length }} shard(s) quarantined (report: `{{ ti.xcom_pull(task_ids='data_gate')['report'] }}`),
weights `{{ ti.xcom_pull(task_ids='train')['weights_sha256'][:16] }}`.

MLflow model version: {{ ti.xcom_pull(task_ids='register_candidate')['ui_url'] }}
Evaluation report (loss curve, metrics against the champion): `{{ ti.xcom_pull(task_ids='register_candidate')['report_uri'] }}`
Quarantine report: `{{ ti.xcom_pull(task_ids='data_gate')['report_html'] }}`
"""


class ReviewOperator(ApprovalOperator):
    """Airflow's ApprovalOperator that also keeps the answer when it is "Reject".

    On reject the stock operator skips downstream by raising, so its return value (who answered,
    when, what) never reaches XCom; the answer is pushed under the key ``review`` first, for the
    ``outcome`` task and the audit trail.
    """

    def execute_complete(self, context, event):  # type: ignore[no-untyped-def]
        if "error" not in event:
            at = event.get("responded_at")
            context["ti"].xcom_push(key="review", value={
                "chosen_options": list(event.get("chosen_options") or []),
                "responded_by_user": dict(event.get("responded_by_user") or {}),
                # No responder: nobody answered within response_timeout and the default (Reject) applied.
                "timed_out": not event.get("responded_by_user"),
                "responded_at": at.isoformat() if hasattr(at, "isoformat") else str(at or ""),
            })
        return super().execute_complete(context, event)


def build_dag(policy: Policy):  # noqa: C901 - one function so the wiring reads top to bottom
    default_args = {
        "owner": policy.owner,
        "retries": policy.retries,
        "retry_delay": timedelta(seconds=20),
        "pool": policy.pool,
        "pool_slots": policy.pool_slots,
        "priority_weight": policy.priority_weight,
    }
    schedule: Any = None
    allowed_run_types = ["manual"]
    if policy.schedule_cron:
        schedule = CronTriggerTimetable(policy.schedule_cron, timezone="UTC")
        allowed_run_types.append("scheduled")
    if policy.schedule_on_corpus_asset:
        asset = corpus_asset(policy.corpus)
        schedule = AssetOrTimeSchedule(timetable=schedule, assets=[asset]) if schedule else [asset]
        allowed_run_types.append("asset_triggered")

    @dag(
        dag_id=policy.dag_id,
        description=policy.description,
        schedule=schedule,
        # No start_date: with one, the cron timetable would start a run for the most recent past
        # Monday as soon as the DAG is unpaused. Without one (and run_immediately=False, the
        # default) the first scheduled run is the next Monday.
        catchup=False,
        max_active_runs=policy.max_active_runs,
        default_args=default_args,
        tags=list(policy.tags),
        doc_md=policy.doc_md(),
        params=_params(policy),
        allowed_run_types=allowed_run_types,
    )
    def kiln_pipeline():
        @task
        def snapshot() -> dict[str, Any]:
            from kiln.pipeline import check_run_conf, snapshot_stage

            ctx = get_current_context()
            # The declared form, not ctx["params"]: Airflow merges unknown conf keys into the latter.
            _run(check_run_conf, policy, ctx["dag_run"].conf or {}, set(ctx["dag"].params.keys()))
            expected = [
                ev.extra["snapshot_id"]
                for events in (ctx.get("triggering_asset_events") or {}).values()
                for ev in events
                if (ev.extra or {}).get("snapshot_id")
            ]
            return _run(snapshot_stage, policy, ctx["params"].get("corpus"), expected or None)

        @task
        def shard_plan(snapshot: dict[str, Any]) -> list[list[str]]:
            """Batches of shards, one mapped validation task each (XCom can only be mapped over a list)."""
            from kiln.pipeline import shard_batches

            return shard_batches(policy, snapshot)

        @task(map_index_template="{{ task.op_kwargs['shards'][0].rsplit('/', 1)[-1] }} … {{ task.op_kwargs['shards'][-1].rsplit('/', 1)[-1] }}")
        def validate_shards(snapshot: dict[str, Any], shards: list[str]) -> list[dict[str, Any]]:
            from kiln.pipeline import validate_stage

            return _run(validate_stage, policy, snapshot, shards)

        @task
        def data_gate(snapshot: dict[str, Any], batches: list[list[dict[str, Any]]]) -> dict[str, Any]:
            from kiln.pipeline import data_gate_stage

            return _run(data_gate_stage, policy, snapshot, list(batches), _key())

        @task
        def train(snapshot: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
            from kiln.pipeline import train_stage

            params = dict(get_current_context()["params"])
            return _run(train_stage, policy, snapshot, data, params, _key())

        @task
        def evaluate(train_result: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
            from kiln.pipeline import evaluate_stage

            return _run(evaluate_stage, train_result, data, _key())

        @task
        def register_candidate(snapshot, data, train_result, evaluation) -> dict[str, Any]:
            from kiln.pipeline import register_stage

            return _run(register_stage, policy, snapshot, data, train_result, evaluation, _key(), {})

        # Skip only what follows directly (approval/promote); `outcome` still runs and says why.
        @task.short_circuit(ignore_downstream_trigger_rules=False)
        def model_gate(candidate: dict[str, Any]) -> dict[str, Any] | bool:
            """Continue to promotion only when the gate says promote; a hold ends the run here, with reasons."""
            from kiln.pipeline import model_gate_stage

            decision = _run(model_gate_stage, candidate)
            print(f"promotion decision: {decision['action']}: " + "; ".join(decision["reasons"]))
            return decision if decision["action"] == "promote" else False

        @task
        def promote(candidate: dict[str, Any], decision: dict[str, Any], approval: dict[str, Any] | None = None):
            from kiln.pipeline import promote_stage

            if approval is not None:
                user = approval.get("responded_by_user") or {}
                approver = user.get("name") or user.get("id") or "unknown"
            else:
                approver = f"policy:{policy.name} (no human approval required)"
            return _run(promote_stage, policy, candidate, decision, approver, _key())

        @task(trigger_rule="none_failed")
        def outcome() -> dict[str, Any]:
            """How the run ended for the model, in words: runs after a promotion, a hold or a rejection
            (skipped upstream), never after a failure (the run fails instead)."""
            from kiln.pipeline import outcome_stage

            ti = get_current_context()["ti"]
            result = _run(
                outcome_stage, policy, ti.xcom_pull(task_ids="register_candidate"),
                ti.xcom_pull(task_ids="approval", key="review") if policy.requires_approval else None,
                ti.xcom_pull(task_ids="promote"), _key(),
            )
            print(result["message"])
            return result

        snap = snapshot()
        reports = validate_shards.partial(snapshot=snap).expand(shards=shard_plan(snap))
        data = data_gate(snap, reports)
        trained = train(snap, data)
        evaluation = evaluate(trained, data)
        candidate = register_candidate(snap, data, trained, evaluation)
        decision = model_gate(candidate)
        if policy.requires_approval:
            approval = ReviewOperator(
                task_id="approval",
                subject=f"Promote a new {policy.target_model} to {policy.alias}?",
                body=APPROVAL_BODY.replace("{policy.target_model}", policy.target_model).replace("{policy.alias}", policy.alias),
                assigned_users=[{"id": user, "name": user} for user in policy.reviewers],
                response_timeout=timedelta(seconds=policy.approval_timeout_s),
                defaults=["Reject"],  # silence is not consent: a timed-out review rejects, and says so
            )
            decision >> approval
            promoted = promote(candidate, decision, approval.output)
        else:
            promoted = promote(candidate, decision)
        promoted >> outcome()

    return kiln_pipeline()

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

import attrs
from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import (
    Asset, AssetOrTimeSchedule, BaseOperator, BaseOperatorLink, CronTriggerTimetable, Param, dag, get_current_context,
    task,
)  # fmt: skip

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


def _mlflow_identity(policy: Policy):  # -> kiln.mlflow_auth.MlflowIdentity | None
    """The policy's MLflow identity: its Airflow connection (``policy.mlflow_conn_id``: login and
    password, from whichever secrets backend holds it), else ``KILN_MLFLOW_<POLICY>_USERNAME`` /
    ``_PASSWORD``, else None (an MLflow server without auth)."""
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    from kiln.mlflow_auth import MlflowIdentity, identity_from_env

    if policy.mlflow_conn_id:
        try:
            conn = Connection.get(policy.mlflow_conn_id)
        except AirflowNotFoundException:
            conn = None
        if conn is not None:
            return MlflowIdentity(conn.login or "", conn.password or "", source=f"connection {policy.mlflow_conn_id}")
    return identity_from_env(policy)


def _run(stage, *args: Any, **kwargs: Any) -> Any:
    """Call one pipeline stage; a non-retryable kiln error fails the task without retry.

    A stage that gets a policy talks to MLflow as that policy's identity (and nothing else: any
    identity the worker's environment carries is set aside for the call); one without a policy,
    anonymously."""
    from airflow.sdk.exceptions import AirflowFailException

    from kiln.errors import KilnError
    from kiln.mlflow_auth import use_identity

    policy = next((a for a in args if isinstance(a, Policy)), None)
    try:
        identity = _mlflow_identity(policy) if policy is not None else None
        if identity is not None:
            log.info("MLflow identity: %s (from %s)", identity.username, identity.source)
        with use_identity(identity):
            return stage(*args, **kwargs)
    except KilnError as exc:
        if not exc.retryable:
            raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc
        raise


def _key() -> str:
    ctx = get_current_context()
    return f"{ctx['dag'].dag_id}/{ctx['run_id']}"


# ------------------------------------------------------------------------------- Airflow UI links
@attrs.define()
class KilnLink(BaseOperatorLink):
    """One extra link of a kiln task (``kiln.links``: which URL, from which XCom or run state).

    Airflow 3 calls ``get_link`` in the task process when the task ends (also after a failure, when
    on-call needs the quarantine report most) and keeps the URL as the XCom ``xcom_key``; the
    api-server's links endpoint and the UI only read that XCom back."""

    kind: str
    policy_name: str

    @property
    def name(self) -> str:
        from kiln.links import LINK_NAMES

        return LINK_NAMES[self.kind]

    @property
    def xcom_key(self) -> str:
        return f"_link_kiln_{self.kind}"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from kiln.links import safe_link_url
        from kiln.mlflow_auth import use_identity
        from kiln.policy import get_policy

        def xcom(task_id: str) -> Any:
            try:
                return ti_key.xcom_pull(task_ids=task_id)
            except Exception:  # no value (failed upstream) or no XCom backend: resolve from run state
                return None

        try:
            identity = _mlflow_identity(get_policy(self.policy_name))
        except Exception:
            log.warning("kiln link %s: no MLflow identity, looking up anonymously", self.kind, exc_info=True)
            identity = None
        with use_identity(identity):
            return safe_link_url(self.kind, dag_id=ti_key.dag_id, run_id=ti_key.run_id, task_id=ti_key.task_id, xcom=xcom)


def _linked_task(policy: Policy, task_id: str, **kwargs: Any):
    """``@task`` whose operator class carries the task's extra links (``kiln.links.TASK_LINKS``).

    Links are an operator *class* attribute in Airflow 3 (a mapped task is re-created from its
    class for each map index), hence one small ``@task`` operator class per linked task."""
    from airflow.providers.standard.decorators.python import _PythonDecoratedOperator
    from airflow.sdk.bases.decorator import task_decorator_factory

    from kiln.links import TASK_LINKS

    links = tuple(KilnLink(kind=kind, policy_name=policy.name) for kind in TASK_LINKS[task_id])
    operator_class = type(f"KilnLinked_{task_id}", (_PythonDecoratedOperator,),
                          {"operator_extra_links": links, "__module__": __name__})  # fmt: skip

    def decorate(fn):  # type: ignore[no-untyped-def]
        return task_decorator_factory(python_callable=fn, decorated_operator_class=operator_class,
                                      **{"multiple_outputs": False, **kwargs})

    return decorate


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
                "timed_out": bool(event.get("timedout")) or not event.get("responded_by_user"),
                "responded_at": at.isoformat() if hasattr(at, "isoformat") else str(at or ""),
            })
        return super().execute_complete(context, event)


APPROVAL_TIMEOUT_VARIABLE = "kiln_{policy}_approval_timeout_s"
"""Airflow Variable (or ``AIRFLOW_VAR_KILN_<POLICY>_APPROVAL_TIMEOUT_S``) an operator sets to change
how long a review waits, without a code change; read when the DAG file is parsed, bounded by
``kiln.policy.APPROVAL_TIMEOUT_MIN_S`` / ``MAX_S``. The environment form is read without a database
call; the DAG's doc shows the timeout in force."""


# ------------------------------------------------------------------------------------- training
LAUNCHER_VARIABLE = "kiln_{policy}_launcher"
"""Airflow Variable (or ``AIRFLOW_VAR_KILN_<POLICY>_LAUNCHER``) that says where this deployment runs a
policy's training: a JSON object of ``kiln.policy.LAUNCHER_FIELDS``, e.g.
``{"launcher": "slurm", "slurm_partition": "gpu", "slurm_conf": "/etc/slurm/prod.conf"}``. Read when
the DAG file is parsed (the dag-processor and the task both parse it, so both see the same policy);
the DAG's doc shows the launcher in force. Anything else about the policy cannot be set this way."""


def _with_launcher_settings(policy: Policy) -> Policy:
    from airflow.sdk import Variable

    name = LAUNCHER_VARIABLE.format(policy=policy.name)
    return policy.with_launcher(Variable.get(name, default=None), f"Airflow Variable {name}")


class TrainOperator(BaseOperator):
    """The ``train`` task: submit the policy's training job and hand back its TrainResult.

    * ``local``: waits in the task. The torchrun agents are children of the task process (the
      launcher's supervisor runs them in this machine's process tree) and their output streams into
      the task log line by line; deferring would leave them running with nobody reading their log on
      the worker that owns them, for no slot saved (the work runs on this worker anyway).
    * ``slurm`` / ``kubernetes``: submits (``sbatch``; a TrainJob), then defers on
      ``LaunchedJobTrigger``: the worker slot (and, by Airflow's default, the pool slot) is free
      while the job queues and runs elsewhere. ``execute_complete`` copies the job log into the task
      log and returns the result, or fails with the launcher's reason (a trainer fault without retry).
      A retry re-attaches to the same job instead of submitting a second gang.
    * Stragglers (slurm / kubernetes): the trigger follows the trainer's flags. ``alert`` is logged;
      the policy's ``exclude_node`` (Slurm) brings the task back with a STRAGGLER event: it ends the
      job, resubmits it without the slow node (resuming from the last committed checkpoint) and
      defers again on the new job (``kiln.pipeline.exclude_straggler``).

    ``on_kill`` (task killed while submitting or waiting here) cancels the job; the trigger's own
    ``on_kill`` does the same for a task killed while deferred, and the DAG's failure callback
    (``end_orphaned_job``) for one killed before a triggerer picked its trigger up.
    """

    template_fields = ("snapshot", "data")
    ui_color = "#f4d9c6"

    def __init__(self, *, policy: Policy, snapshot: Any, data: Any, poll_s: float = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.policy, self.snapshot, self.data, self.poll_s = policy, snapshot, data, poll_s
        self._submitted: tuple[dict[str, Any], dict[str, Any]] | None = None

    def execute(self, context):  # type: ignore[no-untyped-def]
        from kiln.pipeline import prepare_train, straggler_watch, submit_train, train_stage

        params = dict(context["params"])
        if self.policy.launcher == "local":
            return _run(train_stage, self.policy, self.snapshot, self.data, params, _key(), log_line=self.log.info)
        plan = _run(prepare_train, self.policy, self.snapshot, self.data, params, _key())
        if "done" in plan:
            return plan["done"]
        handle = _run(submit_train, plan)
        self.log.info("submitted %s job %s (%s); deferring until it ends", plan["backend"], handle["job_id"], plan["options"])
        self._defer_on(plan, handle, straggler_watch(self.policy, plan))

    def _defer_on(self, plan: dict[str, Any], handle: dict[str, Any], stragglers: dict[str, Any]) -> None:
        from kiln.launchers.triggers import LaunchedJobTrigger

        self._submitted = (plan, handle)
        self.defer(
            trigger=LaunchedJobTrigger(handle=handle, backend=plan["backend"], options=plan["options"],
                                       poll_s=self.poll_s, stragglers=stragglers),
            method_name="execute_complete",
            kwargs={"plan": plan},
        )

    def execute_complete(self, context, event, plan):  # type: ignore[no-untyped-def]
        from kiln.launchers import JobHandle
        from kiln.pipeline import exclude_straggler, finish_train, plan_launcher

        handle = event["handle"]
        if event["state"] == "STRAGGLER":
            self._submitted = (plan, handle)
            self.log.warning("%s", event.get("reason", ""))
            moved = _run(exclude_straggler, self.policy, plan, handle, event)
            self.log.info("%s job %s ended; resubmitted as job %s excluding %s; deferring until it ends",
                          plan["backend"], handle["job_id"], moved["handle"]["job_id"],
                          ",".join(moved["plan"]["options"]["exclude"]))
            self._defer_on(moved["plan"], moved["handle"], moved["stragglers"])
        try:
            text, _ = plan_launcher(plan).logs(JobHandle.from_json(handle), 0)
            for line in text.splitlines():
                self.log.info("%s", line)
        except Exception:  # the job's own log is a convenience; the event says how it ended
            self.log.warning("could not read the log of %s job %s", plan["backend"], handle["job_id"], exc_info=True)
        self.log.info("%s job %s ended: %s %s", plan["backend"], handle["job_id"], event["state"], event.get("reason", ""))
        return _run(finish_train, self.policy, plan, handle, event)

    def on_kill(self) -> None:
        if self._submitted is None:
            return
        from kiln.launchers import JobHandle
        from kiln.pipeline import plan_launcher

        plan, handle = self._submitted
        self.log.info("task killed: cancelling %s job %s", plan["backend"], handle["job_id"])
        plan_launcher(plan).cancel(JobHandle.from_json(handle))


def _train_task(policy: Policy, snapshot: Any, data: Any) -> Any:
    """The train task (``TrainOperator`` with the task's extra links) → its XCom result."""
    from kiln.links import TASK_LINKS

    links = tuple(KilnLink(kind=kind, policy_name=policy.name) for kind in TASK_LINKS["train"])
    operator_class = type("KilnTrainOperator", (TrainOperator,), {"operator_extra_links": links, "__module__": __name__})
    return operator_class(task_id="train", policy=policy, snapshot=snapshot, data=data).output


def end_orphaned_job(context) -> None:  # type: ignore[no-untyped-def]
    """The DAG's failure callback (run by the dag-processor): cancel a training job the failed run
    left queued or running. The trigger's ``on_kill`` covers a deferred task killed while a triggerer
    runs its trigger; this covers one killed before any triggerer picked the trigger up."""
    from kiln.pipeline import cancel_live_job, run_key

    done = cancel_live_job(run_key(context["dag"].dag_id, context["run_id"]))
    if done:
        log.warning("%s", done)


def _with_operator_settings(policy: Policy) -> Policy:
    """The policy as this deployment configured it (today: the review timeout)."""
    if not policy.requires_approval:
        return policy
    from airflow.sdk import Variable

    name = APPROVAL_TIMEOUT_VARIABLE.format(policy=policy.name)
    return policy.with_approval_timeout(Variable.get(name, default=None), f"Airflow Variable {name}")


def _default_args(policy: Policy) -> dict[str, Any]:
    """Task defaults every DAG of a policy shares: owner, retries, its pool and priority."""
    return {
        "owner": policy.owner,
        "retries": policy.retries,
        "retry_delay": timedelta(seconds=20),
        "pool": policy.pool,
        "pool_slots": policy.pool_slots,
        "priority_weight": policy.priority_weight,
    }


def _cron(expression: str) -> CronTriggerTimetable:
    """A UTC cron schedule whose first run is the next cron time after the DAG appears, never the
    one just past. ``run_immediately=timedelta(0)``, not the default False: Airflow 3.3 treats False
    like None and still starts a run less than a tenth of the period late (16.8 h for a weekly
    schedule), so a stack brought up on a Monday morning would start that week's production
    retrain at once."""
    return CronTriggerTimetable(expression, timezone="UTC", run_immediately=timedelta(0))


def build_dag(policy: Policy):  # noqa: C901 - one function so the wiring reads top to bottom
    policy = _with_operator_settings(policy)
    policy = _with_launcher_settings(policy)
    default_args = _default_args(policy)
    schedule: Any = None
    allowed_run_types = ["manual"]
    if policy.schedule_cron:
        schedule = _cron(policy.schedule_cron)
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
        # Monday as soon as the DAG is unpaused. Without one (and run_immediately=timedelta(0),
        # see _cron) the first scheduled run is the next Monday.
        catchup=False,
        max_active_runs=policy.max_active_runs,
        default_args=default_args,
        tags=list(policy.tags),
        doc_md=policy.doc_md(),
        params=_params(policy),
        allowed_run_types=allowed_run_types,
        on_failure_callback=end_orphaned_job,
    )
    def kiln_pipeline():
        @task(multiple_outputs=False)
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

        @task(multiple_outputs=False)
        def shard_plan(snapshot: dict[str, Any]) -> list[list[str]]:
            """Batches of shards, one mapped validation task each (XCom can only be mapped over a list)."""
            from kiln.pipeline import shard_batches

            return shard_batches(policy, snapshot)

        @_linked_task(policy, "validate_shards", map_index_template="{{ task.op_kwargs['shards'][0].rsplit('/', 1)[-1] }} … {{ task.op_kwargs['shards'][-1].rsplit('/', 1)[-1] }}")
        def validate_shards(snapshot: dict[str, Any], shards: list[str]) -> list[dict[str, Any]]:
            from kiln.pipeline import validate_stage

            return _run(validate_stage, policy, snapshot, shards)

        @_linked_task(policy, "data_gate")
        def data_gate(snapshot: dict[str, Any], batches: list[list[dict[str, Any]]]) -> dict[str, Any]:
            from kiln.pipeline import data_gate_stage

            return _run(data_gate_stage, policy, snapshot, list(batches), _key())

        @_linked_task(policy, "evaluate")
        def evaluate(train_result: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
            from kiln.pipeline import evaluate_stage

            return _run(evaluate_stage, train_result, data, _key())

        @_linked_task(policy, "register_candidate")
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

        @task(multiple_outputs=False)
        def promote(candidate: dict[str, Any], decision: dict[str, Any], approval: dict[str, Any] | None = None):
            from kiln.pipeline import promote_stage

            approved_at = None
            if approval is not None:
                user = approval.get("responded_by_user") or {}
                approver = user.get("name") or user.get("id") or "unknown"
                at = approval.get("responded_at")
                approved_at = at.isoformat() if hasattr(at, "isoformat") else (str(at) if at else None)
            else:
                approver = f"policy:{policy.name} (no human approval required)"
            return _run(promote_stage, policy, candidate, decision, approver, _key(), approved_at)

        @task(trigger_rule="none_failed", multiple_outputs=False)
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
        trained = _train_task(policy, snap, data)
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


# ------------------------------------------------------------------------------- champion watch
ROLLBACK_BODY = """\
### Roll `{policy.target_model}@{policy.alias}` back from version {{ ti.xcom_pull(task_ids='decide')['champion_version'] }} to version {{ ti.xcom_pull(task_ids='decide')['previous_version'] }}?

The scheduled re-evaluation found the serving model regressed beyond the policy tolerance
({{ ti.xcom_pull(task_ids='decide')['tolerance'] }} bits per byte) on today's held-out split
(corpus snapshot `{{ ti.xcom_pull(task_ids='decide')['snapshot_id'] }}`).

| bits per byte | champion v{{ ti.xcom_pull(task_ids='decide')['champion_version'] }} | previous v{{ ti.xcom_pull(task_ids='decide')['previous_version'] }} |
|---|---|---|
| today's held-out split | {{ ti.xcom_pull(task_ids='decide')['champion_current_bits_per_byte'] | round(4) }} | {{ ti.xcom_pull(task_ids='decide')['previous_current_bits_per_byte'] | round(4) }} |
| recorded at promotion | {{ ti.xcom_pull(task_ids='decide')['champion_recorded_bits_per_byte'] | round(4) }} | |

{{ ti.xcom_pull(task_ids='decide')['reasons'] | join('; ') }}

**Approve**: `{policy.alias}` moves back to the previous version (audit tags: who, when, why).
**Reject**, or no answer within the timeout: nothing changes.
"""


def build_champion_watch_dag(policy: Policy):
    """The scheduled champion re-evaluation of ``policy`` (``kiln.champion_watch``)::

        reevaluate ─► decide ─► propose_rollback ─► rollback_approval (HITL) ─► rollback ─► watch_outcome

    ``propose_rollback`` lets the run continue only when the watch proposes a rollback; a rejected
    or timed-out review skips ``rollback``; ``watch_outcome`` always says what happened.
    """
    from kiln.errors import PolicyError

    if not (policy.champion_watch_dag_id and policy.champion_watch_cron):
        raise PolicyError(f"policy {policy.name!r} has no champion watch (champion_watch_dag_id/_cron)")
    if not policy.reviewers:
        raise PolicyError(f"policy {policy.name!r}: a champion watch proposes rollbacks to reviewers, and it names none")
    policy = _with_operator_settings(policy)
    default_args = _default_args(policy)

    @dag(
        dag_id=policy.champion_watch_dag_id,
        description=f"Re-evaluates {policy.target_model}@{policy.alias} on the current held-out split; proposes a rollback on regression.",
        schedule=_cron(policy.champion_watch_cron),
        catchup=False,
        max_active_runs=1,
        default_args=default_args,
        tags=[*policy.tags, "champion-watch"],
        doc_md=(build_champion_watch_dag.__doc__ or "") + "\n\n" + policy.doc_md(),
        allowed_run_types=["manual", "scheduled"],
    )
    def kiln_champion_watch():
        @task(multiple_outputs=False)
        def reevaluate() -> dict[str, Any]:
            from kiln.champion_watch import reevaluate_stage

            return _run(reevaluate_stage, policy, _key())

        @task(multiple_outputs=False)
        def decide(evaluation: dict[str, Any]) -> dict[str, Any]:
            from kiln.champion_watch import watch_decision

            decision = _run(watch_decision, evaluation, policy.gate.max_regression)
            print(f"champion watch: {decision['action']}: " + "; ".join(decision["reasons"]))
            return decision

        @task.short_circuit(ignore_downstream_trigger_rules=False)
        def propose_rollback(decision: dict[str, Any]) -> bool:
            return decision["action"] == "propose_rollback"

        @task(multiple_outputs=False)
        def rollback(decision: dict[str, Any], approval: dict[str, Any]) -> dict[str, Any]:
            from kiln.champion_watch import rollback_stage

            return _run(rollback_stage, policy, decision, approval, _key())

        @task(trigger_rule="none_failed", multiple_outputs=False)
        def watch_outcome() -> dict[str, Any]:
            from kiln.champion_watch import watch_outcome_stage

            ti = get_current_context()["ti"]
            result = _run(
                watch_outcome_stage, policy, ti.xcom_pull(task_ids="decide"),
                ti.xcom_pull(task_ids="rollback_approval", key="review"), ti.xcom_pull(task_ids="rollback"), _key(),
            )  # fmt: skip
            print(result["message"])
            return result

        decision = decide(reevaluate())
        approval = ReviewOperator(
            task_id="rollback_approval",
            subject=f"Roll {policy.target_model}@{policy.alias} back to the previous version?",
            body=ROLLBACK_BODY.replace("{policy.target_model}", policy.target_model).replace("{policy.alias}", policy.alias),
            assigned_users=[{"id": user, "name": user} for user in policy.reviewers],
            response_timeout=timedelta(seconds=policy.approval_timeout_s),
            defaults=["Reject"],  # silence is not consent: nothing moves without a named approver
        )
        propose_rollback(decision) >> approval
        rollback(decision, approval.output) >> watch_outcome()

    return kiln_champion_watch()

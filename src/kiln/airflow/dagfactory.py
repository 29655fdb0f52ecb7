"""The one Airflow adapter in kiln: builds a DAG from a Policy. Wiring only.

    snapshot ─► shard_plan ─► validate_shards (mapped over batches) ─► data_gate ─► tokenizer ─► token_plan
        ─► tokenize (mapped over batches) ─► tokens ─► train ─► evaluate ─► register_candidate
        ─► model_gate ─► [approval (HITL), when the policy requires it] ─► promote ─► outcome

Every task body resolves its inputs, calls one ``kiln.stages`` stage and returns a small
JSON-safe reference. This is the one place where XComs and refs meet: an upstream task's XCom
becomes its typed ref (``Ref.from_json``, a malformed one fails the task without retry) before a
stage sees it, and a stage's ref becomes the task's XCom (``to_json``, the wire format each ref
documents). Heavy libraries are imported inside the stages, never at parse time, and no
Airflow Variable or Connection is read then either: the deployment's settings are template fields
rendered when the task that needs them starts (``LAUNCHER_VARIABLE``, ``APPROVAL_TIMEOUT_VARIABLE``).
A kiln fault that a retry cannot fix (``KilnError.retryable is False``: data gate breach, policy
violation, tampered manifest) fails the task without retry.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import attrs
from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import (
    Asset,
    AssetAny,
    AssetOrTimeSchedule,
    BaseOperator,
    BaseOperatorLink,
    CronTriggerTimetable,
    Param,
    dag,
    get_current_context,
    task,
)

from kiln.data.corpora import RUN_CORPUS_CONTRACT, form_choices
from kiln.data.mixtures import available_mixtures
from kiln.data.snapshot import CORPUS_NAME
from kiln.policy import RECIPES_DIR, Policy
from kiln.refs import (
    ApprovalAnswer,
    ChampionEvaluation,
    DataGateResult,
    Decision,
    EvalReport,
    JobEnded,
    PinnedMixture,
    PinnedSnapshot,
    PromotionRecord,
    Ref,
    RegisteredCandidate,
    RollbackRecord,
    ShardReport,
    TokenizerRef,
    TrainResult,
    WatchDecision,
)
from kiln_trainer.contract import PARALLEL_STRATEGIES

if TYPE_CHECKING:
    from kiln.launchers import JobHandle, LaunchPlan
    from kiln.refs import StragglerWatchPlan

log = logging.getLogger("kiln.dag")

R = TypeVar("R", bound=Ref)
T = TypeVar("T")


def corpus_asset(corpus: str) -> Asset:
    """The Asset a corpus snapshot producer emits; ``extra`` carries ``{"snapshot_id": "<md5>.dir"}``."""
    return Asset(name=f"kiln.corpus.{corpus}", uri=f"kiln-corpus://{corpus}", group="kiln-corpus")


def policy_assets(policy: Policy) -> list[Asset] | AssetAny:
    """What an announcement must name to start a run of ``policy``: its corpus' Asset, or any one of
    its mixture's sources' (``AssetAny``: a list would wait for every source to be announced)."""
    if policy.mixture is None:
        return [corpus_asset(policy.corpus)]
    return AssetAny(*(corpus_asset(s.corpus) for s in policy.mixture.sources))


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
    choices = form_choices(policy.corpus)
    return {
        "recipe": Param(policy.default_recipe, type="string", enum=_recipe_choices(policy), title="Recipe",
                        description="Training recipe under training/recipes/. It names its trainer (kiln's, "
                                    "or an entry point of your installed package); one that does not resolve "
                                    "fails the run's first task."),
        "nodes": Param(policy.nodes, type="integer", minimum=1, maximum=2, title="Nodes",
                       description="torchrun agents forming one job (1 process each on the local launcher)."),
        "max_steps": Param(None, type=["null", "integer"], minimum=1, maximum=5000, title="Max steps",
                           description="Override the recipe's step count (empty = recipe default)."),
        "seed": Param(1337, type="integer", minimum=0, maximum=2**31 - 1, title="Seed"),
        "strategy": Param(None, type=["null", "string"], enum=[None, *PARALLEL_STRATEGIES], title="Parallel strategy",
                          description="ddp (replicated model, rank 0 writes checkpoints) or fsdp (FSDP2: sharded "
                                      "model and optimizer, every rank writes its shards); empty = the recipe's."),
        # Offered: the corpora under the corpus root and the shipped contracts, listed at parse time
        # (a directory listing and one small corpus.json per corpus, kiln.data.corpora.form_choices).
        # `examples`, not `enum`, for the corpus: one imported after the last parse can still be typed.
        "corpus": Param(policy.corpus, type="string", pattern=CORPUS_NAME.pattern, title="Corpus",
                        examples=choices.corpora, values_display=choices.corpus_labels,
                        description="A corpus under the DVC workspace's corpora/ folder (`kiln corpus list`; "
                                    "`kiln corpus import` adds one)."),
        # Offered: the mixtures under training/mixtures/ (a directory listing, kiln.data.mixtures).
        "mixture": Param(None, type=["null", "string"], enum=[None, *available_mixtures()], title="Data mixture",
                         description="Train on a mixture of corpora (training/mixtures/NAME.toml: each source a corpus "
                                     "under its own contract, mixed by weight) instead of the one corpus above; empty: "
                                     "the corpus. With a mixture, leave the contract empty: each source has its own."),
        "contract": Param(RUN_CORPUS_CONTRACT, type=["null", "string"], enum=choices.contracts,
                          values_display=choices.contract_labels, title="Data contract",
                          description="The contract the shards are validated with; empty: the one the corpus' "
                                      "corpus.json names. A contract of another family than the corpus' is refused "
                                      "in the first task."),
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


def signing_connection(conn_id: str) -> tuple[str, str] | None:
    """An Airflow connection's (password, extra ``private_key``), from whichever secrets backend holds it;
    None when there is none of that id: where a policy's signing key is read in its own tasks
    (``kiln.provenance.keys.use_policy_key``)."""
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    from kiln.provenance.keys import PRIVATE_KEY_EXTRA

    try:
        conn = Connection.get(conn_id)
    except AirflowNotFoundException:
        return None
    return conn.password or "", str(conn.extra_dejson.get(PRIVATE_KEY_EXTRA) or "")


@contextlib.contextmanager
def _kiln_faults_fail_without_retry() -> Iterator[None]:
    """A kiln error that a retry cannot fix (``retryable is False``) fails the task without retry."""
    from airflow.sdk.exceptions import AirflowFailException

    from kiln.errors import KilnError

    try:
        yield
    except KilnError as exc:
        if not exc.retryable:
            raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc
        raise


def _run(stage: Callable[..., T], *args: Any, mlflow_as: Policy | None, **kwargs: Any) -> T:
    """Call one pipeline stage; a non-retryable kiln error fails the task without retry.

    ``mlflow_as``, which every call names: the policy whose MLflow identity the stage talks to MLflow
    as (and nothing else: any identity the worker's environment carries is set aside for the call);
    None, anonymously."""
    from kiln.mlflow_auth import use_identity
    from kiln.provenance.keys import use_policy_key  # signs as mlflow_as only, its key from its connection

    with _kiln_faults_fail_without_retry():
        identity = _mlflow_identity(mlflow_as) if mlflow_as is not None else None
        if identity is not None:
            log.info("MLflow identity: %s (from %s)", identity.username, identity.source)
        with use_identity(identity), use_policy_key(mlflow_as, signing_connection):
            return stage(*args, **kwargs)


def _from_xcom(ref: type[R], xcom: Any) -> R:
    """An upstream task's XCom (or a trigger's event) as the ref it carries; a malformed one fails the
    task without retry."""
    with _kiln_faults_fail_without_retry():
        return ref.from_json(xcom)


def _pinned(xcom: Any) -> PinnedSnapshot | PinnedMixture:
    """The ``snapshot`` task's XCom: one corpus' snapshot or a mixture's set (``kiln.refs.pinned_input``)."""
    from kiln.refs import pinned_input

    with _kiln_faults_fail_without_retry():
        return pinned_input(xcom)


def _from_optional_xcom(ref: type[R], xcom: Any) -> R | None:
    """``_from_xcom`` of an upstream task that may have pushed nothing (skipped): None then."""
    return None if xcom is None else _from_xcom(ref, xcom)


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
                          {"operator_extra_links": links, "__module__": __name__})

    def decorate(fn):
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
`{{ ti.xcom_pull(task_ids='tokens')['manifest_sha256'][:16] }}`, contract `{{ ti.xcom_pull(task_ids='data_gate')['contract'] }}`,
tokenizer `{{ ti.xcom_pull(task_ids='tokens')['tokens']['tokenizer_kind'] }}` `{{ ti.xcom_pull(task_ids='tokens')['tokens']['tokenizer_sha256'][:16] }}` ({{ ti.xcom_pull(task_ids='tokens')['tokens']['samples'] }} samples),
{{ ti.xcom_pull(task_ids='data_gate')['quarantined'] | length }} shard(s) quarantined (report: `{{ ti.xcom_pull(task_ids='data_gate')['report'] }}`),
weights `{{ ti.xcom_pull(task_ids='train')['weights_sha256'][:16] }}`.

MLflow model version: {{ ti.xcom_pull(task_ids='register_candidate')['ui_url'] }}
Evaluation report (loss curve, metrics against the champion): `{{ ti.xcom_pull(task_ids='register_candidate')['report_uri'] }}`
Quarantine report: `{{ ti.xcom_pull(task_ids='data_gate')['report_html'] }}`
"""  # noqa: E501 - the Markdown's heading and table row cannot wrap


class ReviewOperator(ApprovalOperator):
    """Airflow's ApprovalOperator that records the answer where no Airflow user can forge it.

    Any user with the role "user" may set a task's state or write an XCom in any DAG (the embedded
    stack's auth manager has no per-DAG permissions), so neither is evidence of an approval. The
    answer Airflow hands ``execute_complete`` is: it is built from the HITL record, which only an
    assigned reviewer can write and which names the authenticated responder. This task records it
    on the model version under review, through the policy's MLflow identity (``review_of``:
    ``promotion`` → ``kiln.stages.review_stage``, ``rollback`` →
    ``kiln.stages.champion_watch.rollback_review_stage``); promotion and rollback read it back from there.
    The answer is also pushed under the XCom key ``review`` (also on "Reject", when the stock
    operator skips downstream by raising), for the task log and the UI only. The review waits the
    deployment's timeout (``APPROVAL_TIMEOUT_VARIABLE``, read when the task starts).
    """

    template_fields = (*ApprovalOperator.template_fields, "review_timeout_setting")

    def __init__(self, *, policy: Policy, review_of: str, subject: str, body: str, **kwargs: Any) -> None:
        if review_of not in ("promotion", "rollback"):
            raise ValueError(f"review_of must be 'promotion' or 'rollback', got {review_of!r}")
        super().__init__(
            subject=subject,
            body=body.replace("{policy.target_model}", policy.target_model).replace("{policy.alias}", policy.alias),
            assigned_users=[{"id": user, "name": user} for user in policy.reviewers],
            # The policy's own; execute applies the deployment's at run time.
            response_timeout=timedelta(seconds=policy.approval_timeout_s),
            defaults=["Reject"],  # silence is not consent: a timed-out review rejects, nothing moves
            **kwargs,
        )
        self.policy, self.review_of = policy, review_of
        self.review_timeout_setting = _templated_variable(review_timeout_variable(policy))

    def execute(self, context: Any) -> Any:
        # The timeout in force is the deployment's, read when this task started (not when the DAG
        # file was parsed); set before the stock execute hands it to the scheduler as the deadline.
        deployed = review_timeout_in_force(self.policy, self.review_timeout_setting, self.log.info)
        self.response_timeout = timedelta(seconds=deployed.approval_timeout_s)
        return super().execute(context)

    def execute_complete(self, context, event):
        if "error" not in event:
            at = event.get("responded_at")
            answer = ApprovalAnswer(
                chosen_options=list(event.get("chosen_options") or []),
                responded_by_user=dict(event.get("responded_by_user") or {}),
                # No responder: nobody answered within response_timeout and the default (Reject) applied.
                timed_out=bool(event.get("timedout")) or not event.get("responded_by_user"),
                responded_at=at.isoformat() if hasattr(at, "isoformat") else str(at or ""),
            )
            ti = context["ti"]
            ti.xcom_push(key="review", value=answer.to_json())
            key = f"{context['dag'].dag_id}/{context['run_id']}"
            if self.review_of == "promotion":
                from kiln.stages import review_stage

                candidate = _from_xcom(RegisteredCandidate, ti.xcom_pull(task_ids="register_candidate"))
                recorded = _run(review_stage, self.policy, candidate, answer, key, mlflow_as=self.policy)
            else:
                from kiln.stages.champion_watch import rollback_review_stage

                proposal = _from_xcom(WatchDecision, ti.xcom_pull(task_ids="decide"))
                recorded = _run(rollback_review_stage, self.policy, proposal, answer, key, mlflow_as=self.policy)
            self.log.info("review recorded: %s by %s at %s (%s)", recorded.outcome, recorded.reviewer, recorded.at,
                          recorded.subject)
        return super().execute_complete(context, event)


# -------------------------------------------------------------------- settings read at run time
APPROVAL_TIMEOUT_VARIABLE = "kiln_{policy}_approval_timeout_s"
"""Airflow Variable (or ``AIRFLOW_VAR_KILN_<POLICY>_APPROVAL_TIMEOUT_S``) an operator sets to change
how long a review waits, without a code change; bounded by ``kiln.policy.APPROVAL_TIMEOUT_MIN_S`` /
``MAX_S``. Read when each review task starts (its template field ``review_timeout_setting``, which
``ReviewOperator.execute`` applies before asking), never when the DAG file is parsed; the task log
says the timeout in force (``review timeout in force: …``)."""

LAUNCHER_VARIABLE = "kiln_{policy}_launcher"
"""Airflow Variable (or ``AIRFLOW_VAR_KILN_<POLICY>_LAUNCHER``) that says where this deployment runs a
policy's training: a JSON object of ``kiln.policy.LAUNCHER_FIELDS``, e.g.
``{"launcher": "slurm", "slurm_partition": "gpu", "slurm_conf": "/etc/slurm/prod.conf"}``. Read when
the train task starts (its template field ``launcher_setting``, which ``TrainOperator.execute``
applies), never when the DAG file is parsed; the task log says the launcher in force
(``launcher in force: …``). Anything else about the policy cannot be set this way."""


def launcher_variable(policy: Policy) -> str:
    return LAUNCHER_VARIABLE.format(policy=policy.name)


def review_timeout_variable(policy: Policy) -> str:
    return APPROVAL_TIMEOUT_VARIABLE.format(policy=policy.name)


def _templated_variable(name: str) -> str:
    """A template field's value that Airflow renders when the task starts, never at parse time:
    Variable ``name`` (``Variable.get``'s order: the environment form, the secrets backends, then
    the metadata database), "" when unset. The UI's "Rendered Template" shows what each try read."""
    return "{{ var.value.get(" + repr(name) + ", '') }}"


def _setting_in_force(
    policy: Policy, name: str, raw: str | None, apply: Callable[[Policy, str | None, str], Policy],
    log_line: Callable[..., Any], in_force: Callable[[Policy], str], what: str,
) -> Policy:
    """``policy`` with the deployment setting read from Variable ``name`` (``raw``) applied; says in
    the task log which value is in force and where it came from. A bad value fails the task without
    retry (a retry reads the same value), naming the Variable and what is wrong."""
    with _kiln_faults_fail_without_retry():
        deployed = apply(policy, raw, f"Airflow Variable {name}")
    unset = raw is None or not str(raw).strip()
    log_line("%s in force: %s (%s)", what, in_force(deployed),
             f"the policy's own: Airflow Variable {name} is not set" if unset else f"from Airflow Variable {name}")
    return deployed


def launcher_in_force(policy: Policy, raw: str | None, log_line: Callable[..., Any] = log.info) -> Policy:
    """``policy`` with the launcher settings this deployment gives it (``raw``: ``launcher_variable``)."""
    from kiln.policy import LAUNCHER_FIELDS

    def described(p: Policy) -> str:
        changed = {f: getattr(p, f) for f in LAUNCHER_FIELDS if f != "launcher" and getattr(p, f) != getattr(policy, f)}
        return p.launcher + (f" {changed}" if changed else "")

    return _setting_in_force(policy, launcher_variable(policy), raw, Policy.with_launcher, log_line, described, "launcher")


def review_timeout_in_force(policy: Policy, raw: str | None, log_line: Callable[..., Any] = log.info) -> Policy:
    """``policy`` with the review timeout this deployment gives it (``raw``: ``review_timeout_variable``)."""
    return _setting_in_force(policy, review_timeout_variable(policy), raw, Policy.with_approval_timeout, log_line,
                             lambda p: f"{p.approval_timeout_s} s", "review timeout")


def _launcher_settings(policy: Policy) -> dict[str, Any]:
    """The launcher settings a train task started with, to carry across a deferral."""
    from kiln.policy import LAUNCHER_FIELDS

    return {f: getattr(policy, f) for f in LAUNCHER_FIELDS}


def run_time_settings_doc(policy: Policy, *, train: bool, review_task: str | None) -> list[tuple[str, str, str]]:
    """Rows of the DAG doc's "read at run time" table: (Variable, what it sets, which task reads it)."""
    from kiln.policy import APPROVAL_TIMEOUT_MAX_S, APPROVAL_TIMEOUT_MIN_S, LAUNCHER_FIELDS

    rows = []
    if train:
        rows.append((launcher_variable(policy),
                     f"where training runs: a JSON object of {', '.join(LAUNCHER_FIELDS)}",
                     "`train`, when it starts: log line `launcher in force: …`"))
    if review_task:
        rows.append((review_timeout_variable(policy),
                     f"`approval_timeout_s`: whole seconds within [{APPROVAL_TIMEOUT_MIN_S}, {APPROVAL_TIMEOUT_MAX_S}]",
                     f"`{review_task}`, when it asks: log line `review timeout in force: …`"))
    return rows


# ------------------------------------------------------------------------------------- training


class TrainOperator(BaseOperator):
    """The ``train`` task: submit the policy's training job and hand back its TrainResult.

    Where it runs is the deployment's launcher setting when the task starts (``LAUNCHER_VARIABLE``),
    kept across the task's deferrals; cancelling rebuilds the launcher from the submitted plan.

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
      defers again on the new job (``kiln.stages.exclude_straggler``).

    ``on_kill`` (task killed while submitting or waiting here) cancels the job; the trigger's own
    ``on_kill`` does the same for a task killed while deferred, and the DAG's failure callback
    (``end_orphaned_job``) for one killed before a triggerer picked its trigger up.
    """

    template_fields = ("snapshot", "data", "launcher_setting")
    ui_color = "#f4d9c6"

    def __init__(self, *, policy: Policy, snapshot: Any, data: Any, poll_s: float = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.policy, self.snapshot, self.data, self.poll_s = policy, snapshot, data, poll_s
        self.launcher_setting = _templated_variable(launcher_variable(policy))
        self._submitted: tuple[LaunchPlan, JobHandle] | None = None

    def execute(self, context):  # noqa: RET503 - ends in _defer_on, which raises TaskDeferred
        from kiln.stages import prepare_train, straggler_watch, submit_train, train_stage

        policy = launcher_in_force(self.policy, self.launcher_setting, self.log.info)
        params = dict(context["params"])
        snapshot, data = _pinned(self.snapshot), _from_xcom(DataGateResult, self.data)
        if policy.launcher == "local":
            return _run(train_stage, policy, snapshot, data, params, _key(), log_line=self.log.info,
                        mlflow_as=policy).to_json()
        plan = _run(prepare_train, policy, snapshot, data, params, _key(), mlflow_as=policy)
        if isinstance(plan, TrainResult):  # a retry of a training that already finished
            return plan.to_json()
        handle = _run(submit_train, plan, mlflow_as=None)
        self.log.info("submitted %s job %s (%s); deferring until it ends", plan.backend, handle.job_id, plan.options)
        self._defer_on(plan, handle, straggler_watch(policy, plan), policy)

    def _defer_on(
        self, plan: LaunchPlan, handle: JobHandle, stragglers: StragglerWatchPlan, policy: Policy | None = None,
    ) -> NoReturn:
        """Defer on the submitted job; ``policy``: the settings this try runs with (default: the task's)."""
        from kiln.airflow.triggers import LaunchedJobTrigger

        policy = policy or self.policy
        self._submitted = (plan, handle)
        self.defer(
            trigger=LaunchedJobTrigger(handle=handle.to_json(), backend=plan.backend, options=plan.options,
                                       poll_s=self.poll_s, stragglers=stragglers.to_json()),
            method_name="execute_complete",
            # The settings this try started with: a Variable changed while the job runs does not
            # change how this job's stragglers are handled.
            kwargs={"plan": plan.to_json(), "launcher_settings": _launcher_settings(policy)},
        )

    def execute_complete(
        self, context: Any, event: dict[str, Any], plan: dict[str, Any], launcher_settings: dict[str, Any] | None = None,
    ) -> Any:
        """``plan``: the ``LaunchPlan`` as JSON, as ``_defer_on`` carried it across the deferral."""
        from kiln.launchers import JobHandle, LaunchPlan
        from kiln.stages import exclude_straggler, finish_train

        # None: deferred by a kiln that did not carry them along (the policy's own settings then).
        with _kiln_faults_fail_without_retry():
            policy = self.policy.with_launcher(launcher_settings, "the launcher settings this train task started with")
            launch = LaunchPlan.from_json(plan)
        handle = JobHandle.from_json(event["handle"])
        if event["state"] == "STRAGGLER":
            self._submitted = (launch, handle)
            self.log.warning("%s", event.get("reason", ""))
            moved, moved_handle, stragglers = _run(exclude_straggler, policy, launch, handle, str(event["node"]),
                                                   mlflow_as=policy)
            self.log.info("%s job %s ended; resubmitted as job %s excluding %s; deferring until it ends",
                          launch.backend, handle.job_id, moved_handle.job_id, ",".join(moved.options["exclude"]))
            self._defer_on(moved, moved_handle, stragglers, policy)
        try:
            text, _ = launch.launcher().logs(handle, 0)
            for line in text.splitlines():
                self.log.info("%s", line)
        except Exception:  # the job's own log is a convenience; the event says how it ended
            self.log.warning("could not read the log of %s job %s", launch.backend, handle.job_id, exc_info=True)
        self.log.info("%s job %s ended: %s %s", launch.backend, handle.job_id, event["state"], event.get("reason", ""))
        return _run(finish_train, policy, launch, handle, _from_xcom(JobEnded, event), mlflow_as=policy).to_json()

    def on_kill(self) -> None:
        if self._submitted is None:
            return
        plan, handle = self._submitted
        self.log.info("task killed: cancelling %s job %s", plan.backend, handle.job_id)
        plan.launcher().cancel(handle)


def _train_task(policy: Policy, snapshot: Any, data: Any) -> Any:
    """The train task (``TrainOperator`` with the task's extra links) → its XCom result."""
    from kiln.links import TASK_LINKS

    links = tuple(KilnLink(kind=kind, policy_name=policy.name) for kind in TASK_LINKS["train"])
    operator_class = type("KilnTrainOperator", (TrainOperator,), {"operator_extra_links": links, "__module__": __name__})
    return operator_class(task_id="train", policy=policy, snapshot=snapshot, data=data).output


def end_orphaned_job(context) -> None:
    """The DAG's failure callback (run by the dag-processor): cancel a training job the failed run
    left queued or running. The trigger's ``on_kill`` covers a deferred task killed while a triggerer
    runs its trigger; this covers one killed before any triggerer picked the trigger up."""
    from kiln.runs import run_key
    from kiln.stages import cancel_live_job

    done = cancel_live_job(run_key(context["dag"].dag_id, context["run_id"]))
    if done:
        log.warning("%s", done)


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


def build_dag(policy: Policy):  # one function, so the wiring reads top to bottom
    default_args = _default_args(policy)
    schedule: Any = None
    allowed_run_types = ["manual"]
    if policy.schedule_cron:
        schedule = _cron(policy.schedule_cron)
        allowed_run_types.append("scheduled")
    if policy.schedule_on_corpus_asset:
        assets = policy_assets(policy)
        schedule = AssetOrTimeSchedule(timetable=schedule, assets=assets) if schedule else assets
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
        doc_md=policy.doc_md(run_time_settings_doc(policy, train=True,
                                                   review_task="approval" if policy.requires_approval else None)),
        params=_params(policy),
        # Airflow converts the names (DagRunType(name)); its annotation asks for the SDK's private enum.
        allowed_run_types=allowed_run_types,  # type: ignore[arg-type]
        on_failure_callback=end_orphaned_job,
    )
    def kiln_pipeline():
        @task(multiple_outputs=False)
        def snapshot() -> dict[str, Any]:
            from kiln.stages import check_run_conf, snapshot_run_stage

            ctx = get_current_context()
            # The declared form, not ctx["params"]: Airflow merges unknown conf keys into the latter.
            _run(check_run_conf, policy, ctx["dag_run"].conf or {}, set(ctx["dag"].params.keys()), dict(ctx["params"]),
                 mlflow_as=policy)
            expected = [
                ev.extra["snapshot_id"]
                for events in (ctx.get("triggering_asset_events") or {}).values()
                for ev in events
                if (ev.extra or {}).get("snapshot_id")
            ]
            # One corpus, or each source of the mixture the run names; a contract that does not fit: now.
            pinned = _run(snapshot_run_stage, policy, dict(ctx["params"]), expected or None, mlflow_as=policy)
            return pinned.to_json()

        @task(multiple_outputs=False)
        def shard_plan(snapshot: dict[str, Any]) -> list[list[str]]:
            """Batches of shards, one mapped validation task each (XCom can only be mapped over a list);
            a mixture's batch is of one source (``<source>:<shard>``)."""
            from kiln.stages import run_shard_batches

            return run_shard_batches(policy, _pinned(snapshot))

        # "shard-00000.parquet … shard-00003.parquet"; a mixture's batch with its source: "code: shard-… … shard-…".
        @_linked_task(policy, "validate_shards",
                      map_index_template="{% set head = task.op_kwargs['shards'][0].split('/', 1)[0] %}"
                                         "{{ head.split(':', 1)[0] ~ ': ' if ':' in head else '' }}"
                                         "{{ task.op_kwargs['shards'][0].rsplit('/', 1)[-1] }}"
                                         " … {{ task.op_kwargs['shards'][-1].rsplit('/', 1)[-1] }}")
        def validate_shards(snapshot: dict[str, Any], shards: list[str]) -> list[dict[str, Any]]:
            from kiln.stages import validate_run_stage

            reports = _run(validate_run_stage, policy, dict(get_current_context()["params"]), _pinned(snapshot), shards,
                           _key(), mlflow_as=policy)
            return [r.as_xcom().to_json() for r in reports]  # dropped rows as a digest: the record has them

        @_linked_task(policy, "data_gate")
        def data_gate(snapshot: dict[str, Any], batches: list[list[dict[str, Any]]]) -> dict[str, Any]:
            from kiln.stages import data_gate_run_stage

            reports = [[_from_xcom(ShardReport, r) for r in batch] for batch in batches]
            return _run(data_gate_run_stage, policy, dict(get_current_context()["params"]), _pinned(snapshot), reports,
                        _key(), mlflow_as=policy).to_json()

        @task(multiple_outputs=False)
        def tokenizer(data: dict[str, Any]) -> dict[str, Any]:
            """The tokenizer the run's recipe asks for, stored by its sha256 (a BPE trains here)."""
            from kiln.stages import tokenizer_stage

            params = dict(get_current_context()["params"])
            return _run(tokenizer_stage, policy, _from_xcom(DataGateResult, data), params, _key(), mlflow_as=None).to_json()

        @task(multiple_outputs=False)
        def token_plan(data: dict[str, Any]) -> list[list[int]]:
            """Batches of the healthy shards, one mapped tokenize task each."""
            from kiln.stages import token_parts

            return token_parts(policy, _from_xcom(DataGateResult, data))

        @task(multiple_outputs=False,
              map_index_template="shards {{ task.op_kwargs['parts'][0] }} … {{ task.op_kwargs['parts'][-1] }}")
        def tokenize(data: dict[str, Any], tokenizer_ref: dict[str, Any], parts: list[int]) -> int:
            """Pack one batch of shards into token shards; the number of samples packed."""
            from kiln.stages import tokenize_stage

            params = dict(get_current_context()["params"])
            packed = _run(tokenize_stage, policy, _from_xcom(DataGateResult, data), _from_xcom(TokenizerRef, tokenizer_ref),
                          list(parts), params, _key(), mlflow_as=None)
            return sum(part.samples for part in packed)

        @task(multiple_outputs=False)
        def tokens(data: dict[str, Any], tokenizer_ref: dict[str, Any]) -> dict[str, Any]:
            """Join the parts into the token manifest; the run's training manifest names it from now on."""
            from kiln.stages import tokens_stage

            params = dict(get_current_context()["params"])
            return _run(tokens_stage, policy, _from_xcom(DataGateResult, data), _from_xcom(TokenizerRef, tokenizer_ref),
                        params, _key(), mlflow_as=None).to_json()

        @_linked_task(policy, "evaluate")
        def evaluate(train_result: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
            from kiln.stages import evaluate_stage

            return _run(evaluate_stage, _from_xcom(TrainResult, train_result), _from_xcom(DataGateResult, data), _key(),
                        mlflow_as=None).to_json()

        @_linked_task(policy, "register_candidate")
        def register_candidate(snapshot: dict[str, Any], data: dict[str, Any], train_result: dict[str, Any],
                               evaluation: dict[str, Any]) -> dict[str, Any]:
            from kiln.stages import register_stage

            return _run(register_stage, policy, _pinned(snapshot), _from_xcom(DataGateResult, data),
                        _from_xcom(TrainResult, train_result), _from_xcom(EvalReport, evaluation), _key(), {},
                        mlflow_as=policy).to_json()

        # Skip only what follows directly (approval/promote); `outcome` still runs and says why.
        @task.short_circuit(ignore_downstream_trigger_rules=False)
        def model_gate(candidate: dict[str, Any]) -> dict[str, Any] | bool:
            """Continue to promotion only when the gate says promote; a hold ends the run here, with reasons."""
            from kiln.stages import model_gate_stage

            decision = _run(model_gate_stage, _from_xcom(RegisteredCandidate, candidate), mlflow_as=None)
            print(f"promotion decision: {decision.action}: " + "; ".join(decision.reasons))
            return decision.to_json() if decision.action == "promote" else False

        @task(multiple_outputs=False)
        def promote(candidate: dict[str, Any], decision: dict[str, Any]) -> dict[str, Any]:
            """Promote this run's candidate; the approval is what the approval task recorded in the
            registry (``kiln.registry.promote``), never this task's inputs or upstream states."""
            from kiln.stages import promote_stage

            return _run(promote_stage, policy, _from_xcom(RegisteredCandidate, candidate), _from_xcom(Decision, decision),
                        _key(), mlflow_as=policy).to_json()

        @task(trigger_rule="none_failed", multiple_outputs=False)
        def outcome(review_timeout_setting: str = "") -> dict[str, Any]:
            """How the run ended for the model, in words: runs after a promotion, a hold or a rejection
            (skipped upstream), never after a failure (the run fails instead)."""
            from kiln.stages import outcome_stage

            ti = get_current_context()["ti"]
            # With the review timeout in force, for the words about a review nobody answered.
            deployed = review_timeout_in_force(policy, review_timeout_setting) if policy.requires_approval else policy
            candidate = _from_xcom(RegisteredCandidate, ti.xcom_pull(task_ids="register_candidate"))
            promotion = _from_optional_xcom(PromotionRecord, ti.xcom_pull(task_ids="promote"))
            result = _run(outcome_stage, deployed, candidate, promotion, _key(), mlflow_as=deployed)
            print(result.message)
            return result.to_json()

        snap = snapshot()
        reports = validate_shards.partial(snapshot=snap).expand(shards=shard_plan(snap))
        gated = data_gate(snap, reports)
        tok = tokenizer(gated)
        packed = tokenize.partial(data=gated, tokenizer_ref=tok).expand(parts=token_plan(gated))
        data = tokens(gated, tok)
        packed >> data
        trained = _train_task(policy, snap, data)
        evaluation = evaluate(trained, data)
        candidate = register_candidate(snap, data, trained, evaluation)
        decision = model_gate(candidate)
        if policy.requires_approval:
            approval = ReviewOperator(task_id="approval", policy=policy, review_of="promotion",
                                      subject=f"Promote a new {policy.target_model} to {policy.alias}?", body=APPROVAL_BODY)
            promoted = promote(candidate, decision)
            decision >> approval >> promoted
        else:
            promoted = promote(candidate, decision)
        if policy.requires_approval:
            promoted >> outcome(review_timeout_setting=_templated_variable(review_timeout_variable(policy)))
        else:
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
"""  # noqa: E501 - the Markdown's heading and table rows cannot wrap


def build_champion_watch_dag(policy: Policy):
    """The scheduled champion re-evaluation of ``policy`` (``kiln.stages.champion_watch``)::

        reevaluate ─► decide ─► propose_rollback ─► rollback_approval (HITL) ─► rollback ─► watch_outcome

    ``propose_rollback`` lets the run continue only when the watch proposes a rollback; a rejected
    or timed-out review skips ``rollback``; ``watch_outcome`` always says what happened.
    """
    from kiln.errors import PolicyError

    if not policy.champion_watch_dag_id:
        raise PolicyError(f"policy {policy.name!r} has no champion watch (champion_watch_dag_id)")
    if not policy.reviewers:
        raise PolicyError(f"policy {policy.name!r}: a champion watch proposes rollbacks to reviewers, and it names none")
    default_args = _default_args(policy)

    @dag(
        dag_id=policy.champion_watch_dag_id,
        description=f"Re-evaluates {policy.target_model}@{policy.alias} on the current held-out split; "
                    "proposes a rollback on regression.",
        schedule=_cron(policy.champion_watch_cron) if policy.champion_watch_cron else None,  # None: by hand
        catchup=False,
        max_active_runs=1,
        default_args=default_args,
        tags=[*policy.tags, "champion-watch"],
        doc_md=(build_champion_watch_dag.__doc__ or "") + "\n\n"
        + policy.doc_md(run_time_settings_doc(policy, train=False, review_task="rollback_approval")),
        allowed_run_types=["manual", "scheduled"] if policy.champion_watch_cron else ["manual"],  # type: ignore[list-item]  # names, as above
    )
    def kiln_champion_watch():
        @task(multiple_outputs=False)
        def reevaluate() -> dict[str, Any]:
            from kiln.stages.champion_watch import reevaluate_stage

            return _run(reevaluate_stage, policy, _key(), mlflow_as=policy).to_json()

        @task(multiple_outputs=False)
        def decide(evaluation: dict[str, Any]) -> dict[str, Any]:
            from kiln.stages.champion_watch import watch_decision

            decision = _run(watch_decision, _from_xcom(ChampionEvaluation, evaluation), policy.gate.max_regression,
                            mlflow_as=None)
            print(f"champion watch: {decision.action}: " + "; ".join(decision.reasons))
            return decision.to_json()

        @task.short_circuit(ignore_downstream_trigger_rules=False)
        def propose_rollback(decision: dict[str, Any]) -> bool:
            return _from_xcom(WatchDecision, decision).action == "propose_rollback"

        @task(multiple_outputs=False)
        def rollback(decision: dict[str, Any]) -> dict[str, Any]:
            """Roll back on the approval ``rollback_approval`` recorded in the registry, never on this
            task's inputs or upstream states."""
            from kiln.stages.champion_watch import rollback_stage

            return _run(rollback_stage, policy, _from_xcom(WatchDecision, decision), _key(), mlflow_as=policy).to_json()

        @task(trigger_rule="none_failed", multiple_outputs=False)
        def watch_outcome(review_timeout_setting: str) -> dict[str, Any]:
            from kiln.stages.champion_watch import watch_outcome_stage

            ti = get_current_context()["ti"]
            proposal = _from_optional_xcom(WatchDecision, ti.xcom_pull(task_ids="decide"))
            rolled_back = _from_optional_xcom(RollbackRecord, ti.xcom_pull(task_ids="rollback"))
            deployed = review_timeout_in_force(policy, review_timeout_setting)
            result = _run(watch_outcome_stage, deployed, proposal, rolled_back, _key(), mlflow_as=deployed)
            print(result.message)
            return result.to_json()

        decision = decide(reevaluate())
        approval = ReviewOperator(task_id="rollback_approval", policy=policy, review_of="rollback",
                                  subject=f"Roll {policy.target_model}@{policy.alias} back to the previous version?",
                                  body=ROLLBACK_BODY)
        propose_rollback(decision) >> approval >> rollback(decision) >> watch_outcome(
            review_timeout_setting=_templated_variable(review_timeout_variable(policy)))

    return kiln_champion_watch()


# ------------------------------------------------------------------------------------- reproduce
def _reproduce_params() -> dict[str, Param]:
    """The form of ``kiln reproduce``: each field one of the command's arguments (checked again, as the command
    checks them, in the run's first task: ``kiln.cli.reproduce.resolve_request``)."""
    from kiln.provenance.reproduce import DEFAULT_TOLERANCE

    return {
        "version": Param(type="string", minLength=1, maxLength=300, title="Version",
                         description="The registered version to re-derive: MODEL@ALIAS (kiln-stdlib-lm@champion) or "
                                     "MODEL/VERSION (kiln-stdlib-lm/3). A reference of neither form fails the run's "
                                     "first task, naming it."),
        "policy": Param(None, type=["null", "string"], enum=[None, "production", "sandbox"],
                        title="Verify for policy",
                        description="Whose trusted keys verify the version before anything is derived (`kiln "
                                    "reproduce --policy`); empty: the policy that owns the model, else production. "
                                    "The reproduction itself always runs, signs and records as sandbox."),
        "world_size": Param(None, type=["null", "integer"], minimum=1, title="World size",
                            description="Re-derive at this many ranks instead of the recorded world size "
                                        "(`--world-size`): the weights are then held to the registered ones within the "
                                        "tolerance, not by sha256, and it must split the recorded global batch. Empty: "
                                        "the recorded world size, bit for bit."),
        "tolerance": Param(None, type=["null", "number"], minimum=0, title="Tolerance",
                           description="Only with a world size (`--tolerance`): the largest absolute weight difference "
                                       f"that still reproduces; empty: {DEFAULT_TOLERANCE:g} (measured, "
                                       "docs/provenance.md)."),
        "allow_code_drift": Param(False, type="boolean", title="Allow code drift",
                                  description="Go on when the installed kiln code is not the recorded code "
                                              "(`--allow-code-drift`); the drift is reported. Off: refused."),
    }


REPRODUCE_DOC = """\
**Reproduce a registered version** (`kiln reproduce` from the form; docs/provenance.md, "The `kiln_reproduce`
DAG"): verify the version for the chosen policy, re-derive it step by step from its signed statement and the
DVC remote, and record the verdict.

    request ─► reproduce ─► outcome

* `request` checks the form as the command checks its arguments (a reference that is neither MODEL@ALIAS nor
  MODEL/VERSION, a tolerance without a world size, a run parameter the form does not have: failed, no retry).
* `reproduce` runs `kiln.provenance.reproduce.reproduce` with the run's key (the MLflow run and the torchrun
  rendezvous are named after this DAG run) in a fresh work directory per try (`<run dir>/reproduction/try-N`);
  its XCom is the outcome (`Reproduction.to_json`), its log the steps and the verdict in words. It trains
  with kiln's local launcher on the worker that runs the task (torchrun, one process per rank), as the
  command does; the deployment's `kiln_sandbox_launcher` Variable is not read.
* `outcome` says where the verdict is recorded and fails the run, without retry, when it is `differs` or
  `refused`: after it was recorded, never by re-deriving again.

**In sandbox capacity.** Every task runs in the sandbox's pool, priority, retries and Celery queue and talks to
MLflow as the sandbox identity, whatever the version's policy: the attestation is signed with sandbox's key and
logged to a run of the `kiln-sandbox` experiment (tag `kiln.reproduction.of = MODEL/VERSION`). The version's
`kiln.reproduction.*` tags are set when that identity may write them; under MLflow's basic auth it only reads
production's models, the registry refuses them (403), and the run does not fail: `outcome` says that the verdict
is recorded in that run, not on the version (`kiln verify` finds it there).
"""


def build_reproduce_dag(policy: Policy):
    """The ``kiln_reproduce`` DAG (``kiln.provenance.reproduce.REPRODUCE_DAG_ID``): ``kiln reproduce`` from the
    Airflow form, by hand only, in the capacity of ``policy`` (the sandbox's: its pool, priority, retries, queue
    and MLflow identity). ``PolicyError`` for any other policy: reproduction writes no production name."""
    from kiln.errors import PolicyError
    from kiln.provenance.reproduce import REPRODUCE_DAG_ID

    if policy.name != "sandbox":
        raise PolicyError(f"the {REPRODUCE_DAG_ID} DAG runs in sandbox capacity, not policy {policy.name!r}'s "
                          "(its attestation is signed with sandbox's key and logged to sandbox's experiment)")

    @dag(
        dag_id=REPRODUCE_DAG_ID,
        description="Re-derive a registered version from its signed provenance statement (kiln reproduce), "
                    "in sandbox capacity.",
        schedule=None,
        catchup=False,
        max_active_runs=policy.max_active_runs,
        default_args=_default_args(policy),
        tags=[*policy.tags, "reproduce"],
        doc_md=REPRODUCE_DOC + "\n" + policy.doc_md(run_time_settings_doc(policy, train=False, review_task=None)),
        params=_reproduce_params(),
        allowed_run_types=["manual"],  # type: ignore[list-item]  # names, as in build_dag
    )
    def kiln_reproduce():
        @task(multiple_outputs=False)
        def request() -> dict[str, Any]:
            """The form's values as ``kiln reproduce`` would take them; a bad one fails here, without retry."""
            from kiln.cli.reproduce import resolve_request
            from kiln.errors import ConfigError

            ctx = get_current_context()
            params = dict(ctx["params"])
            # The declared form, not ctx["params"]: Airflow merges unknown conf keys into the latter.
            unknown = sorted(set(ctx["dag_run"].conf or {}) - set(ctx["dag"].params.keys()))

            def resolve() -> tuple[str, str, str, str]:
                if unknown:
                    raise ConfigError(f"{REPRODUCE_DAG_ID} does not take run parameter(s) {', '.join(unknown)}; "
                                      f"allowed: {', '.join(sorted(ctx['dag'].params.keys()))}")
                return resolve_request(str(params.get("version") or ""), params.get("policy"),
                                       world_size=params.get("world_size"), tolerance=params.get("tolerance"))

            model, by, name, verify_for = _run(resolve, mlflow_as=None)
            asked = {"model": model, "by": by, "name": name, "policy": verify_for,
                     "world_size": params.get("world_size"), "tolerance": params.get("tolerance"),
                     "allow_code_drift": bool(params.get("allow_code_drift"))}
            print(f"reproduce {model} {'@' if by == 'alias' else '/'}{name}, verified for policy {verify_for}: {asked}")
            return asked

        @task(multiple_outputs=False)
        def reproduce(asked: dict[str, Any]) -> dict[str, Any]:
            """Re-derive and record the verdict (``kiln.provenance.reproduce.reproduce``); the outcome as XCom.
            A verdict is a value, not a fault: this task succeeds on ``differs`` and ``refused`` too."""
            from kiln import runs
            from kiln.provenance.reproduce import reproduce as reproduce_version

            ctx = get_current_context()
            key = _key()
            # A fresh directory per try: a retry never meets its predecessor's leftovers (reproduce() refuses a
            # work directory that is not empty); the MLflow run is the same one (found by the run key).
            workdir = runs.run_dir(key) / "reproduction" / f"try-{ctx['ti'].try_number}"
            outcome = _run(reproduce_version, asked["model"], asked["name"], by=asked["by"], policy=asked["policy"],
                           allow_code_drift=asked["allow_code_drift"], workdir=workdir, record=True,
                           world_size=asked["world_size"], tolerance=asked["tolerance"], run_key=key,
                           log=lambda line: print(f"[reproduce] {line}", flush=True), mlflow_as=policy)
            for line in outcome.in_words():
                print(line)
            return outcome.to_json()

        @task(multiple_outputs=False)
        def outcome(result: dict[str, Any]) -> dict[str, Any]:
            """Where the verdict is recorded, in words; fails the run without retry unless it is ``reproduced``."""
            from airflow.sdk.exceptions import AirflowFailException

            from kiln.provenance.attestation import NOT_ON_VERSION, reproducer_experiment

            refused = next((n for n in result.get("notes") or [] if n.startswith(NOT_ON_VERSION)), None)
            uri = result.get("attestation_uri") or ""
            run_id = uri.removeprefix("runs:/").split("/", 1)[0] if uri else ""
            where = ("on the version's kiln.reproduction.* tags" + (f" and in MLflow run {run_id}" if run_id else "")
                     if refused is None else f"in MLflow run {run_id} of experiment {reproducer_experiment()}, not "
                                             "on the version (its tags were refused)")
            said = result.get("reason") or "every step gave the recorded digest"
            message = (f"{result['model']} version {result['version']} (verified for {result['policy']}): "
                       f"{result['verdict']}: {said}. Recorded {where}"
                       + (f"; signed attestation {uri}" if uri else ""))
            print(message)
            if result["verdict"] != "reproduced":
                raise AirflowFailException(message)
            return {"model": result["model"], "version": result["version"], "verdict": result["verdict"],
                    "recorded_on_version": refused is None, "attestation_uri": uri}

        outcome(reproduce(request()))

    return kiln_reproduce()

"""The promotion gate and the MLflow registry writes: register, decide, promote, roll back.

One module per concern; this package re-exports the API the stages, the CLI and the champion watch
call::

    gate        decide: the pure decision (metrics in, Decision out)
    mlflow_io   the MLflow client, retries with backoff, MLflow errors translated to kiln's
    tags        the kiln.* tag keys and the pure tag <-> ref conversions
    register    checkpoint checks, lineage, register_candidate, the champion's report
    report      the reviewer's report: loss curve, markdown, HTML, the version description
    review      a run's human review, recorded as tags; the approval promotion asks for
    promote     promote and rollback: the alias moved last
    audit       the audit trail of reviews, promotions and rollbacks; each version checked against
                its signed provenance statement (provenance_checks)

The *decision* is pure (``decide``: metrics in, ``Decision`` out, no I/O); the *writes* are the
other functions here, each idempotent and keyed by the Airflow run (``run_key`` =
``"<dag_id>/<run_id>"``)::

    register_candidate(...)      verify checkpoint → policy check → find-or-create a version in
                                 policy.candidate_model, tagged with its lineage
    champion_report(policy)      EvalReport of the version holding policy.alias (None: first model)
    decide(cand, champ, gate)    Decision("promote" | "hold", reasons)
    record_review(...)           the run's human review (approved / rejected / timed out), as
                                 its approval task got it from Airflow, as tags on the candidate;
                                 never moves an alias
    promote(...)                 the approval: the review recorded for this run and version (or a
                                 named person's manual ``kiln promote``) → the decision recorded
                                 at registration (never the caller's), gate again if the
                                 champion changed since → copy into
                                 policy.target_model → all tags → ``previous`` alias →
                                 policy.alias LAST, so readers never see a half-promoted model
    rollback(model, policy, …)   policy.alias back to the version holding ``previous`` (audited)

Every version this module writes carries its facts as tags prefixed ``kiln.`` (see ``TAGS``), so
a reviewer reads the lineage in the MLflow UI and ``champion_report`` reads the champion's metrics
back without any other store. mlflow is imported inside the functions (importing this module stays
cheap) and its errors are translated here: ``raise RegistryError(...) from exc``.

An unreachable or overloaded server (connection refused, timeout, HTTP 5xx/429) is retried with
exponential backoff, bounded by ``KILN_REGISTRY_RETRIES`` (default 3 retries),
``KILN_REGISTRY_BACKOFF_S`` (first wait, default 2 s, doubled each time) and
``KILN_REGISTRY_BACKOFF_MAX_S`` (cap, default 30 s); then the call raises a retryable
``RegistryError`` and the Airflow task retries. Each retry re-runs the *whole* operation from its
first read: that is safe only because every write here is find-or-create keyed by the run, so a
half-done attempt is completed, never repeated. (mlflow's own per-request retries,
``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, run inside each attempt and also retry POSTs: a lost response
to a create can leave a second version with the same run key, which the next find removes.)

Reviewers read, in the MLflow UI: the version's description (gate, metrics against the champion,
lineage summary), the run's ``evaluation/report.html`` (self-contained: loss curve, metrics against
the champion, gate reasons, lineage), ``evaluation/report.md`` and ``evaluation/loss_curve.png``
(``.svg`` when matplotlib is not installed).
"""

from __future__ import annotations

from kiln.registry.audit import (
    AUDIT_EVENTS,
    AUDIT_PREFIX,
    AUDIT_TEXT_MAX,
    audit_history,
    audit_tag,
    provenance_checks,
)
from kiln.registry.gate import decide
from kiln.registry.mlflow_io import RetryPolicy, is_transient
from kiln.registry.promote import promote, rollback
from kiln.registry.register import RunRecords, champion_report, lineage_tags, register_candidate, version_report
from kiln.registry.report import (
    LossCurve,
    loss_curve,
    loss_curve_png,
    loss_curve_svg,
    read_loss_jsonl,
    report_html,
    report_markdown,
)
from kiln.registry.review import (
    promotion_subject,
    record_review,
    record_rollback_review,
    recorded_review,
    rollback_approval,
    rollback_subject,
)
from kiln.registry.tags import (
    CHECKPOINT_MANIFEST_NAME,
    EVAL_SPLIT,
    LOSS_METRIC,
    MODEL_ARTIFACT_NAME,
    PREVIOUS_ALIAS,
    REPORT_DIR,
    REVIEW_OUTCOMES,
    REVIEW_TAGS,
    RUN_MODEL_URI_TAG,
    RUN_STATUS_TAG,
    TAGS,
    utc_now,
)

__all__ = [
    "AUDIT_EVENTS",
    "AUDIT_PREFIX",
    "AUDIT_TEXT_MAX",
    "CHECKPOINT_MANIFEST_NAME",
    "EVAL_SPLIT",
    "LOSS_METRIC",
    "LossCurve",
    "MODEL_ARTIFACT_NAME",
    "PREVIOUS_ALIAS",
    "REPORT_DIR",
    "REVIEW_OUTCOMES",
    "REVIEW_TAGS",
    "RUN_MODEL_URI_TAG",
    "RUN_STATUS_TAG",
    "RetryPolicy",
    "TAGS",
    "audit_history",
    "audit_tag",
    "champion_report",
    "decide",
    "is_transient",
    "lineage_tags",
    "loss_curve",
    "loss_curve_png",
    "loss_curve_svg",
    "promote",
    "promotion_subject",
    "provenance_checks",
    "read_loss_jsonl",
    "record_review",
    "record_rollback_review",
    "recorded_review",
    "register_candidate",
    "RunRecords",
    "report_html",
    "report_markdown",
    "rollback",
    "rollback_approval",
    "rollback_subject",
    "utc_now",
    "version_report",
]

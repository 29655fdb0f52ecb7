"""Airflow cluster policy of the production-like stacks: each policy's DAGs run on its own Celery queue.

Installed as ``airflow_local_settings`` (``kiln.stack.prodlike`` writes it; the Airflow image copies
``docker/airflow/airflow_local_settings.py``), so every Airflow process imports this module: it
imports nothing but ``kiln.policy``. A queue is served by a worker that holds only that policy's
MLflow identity, so every DAG of a policy — the retraining DAG and the champion watch — must land
on it: a production DAG on the sandbox worker would talk to MLflow without the production identity.
``kiln_reproduce`` runs in sandbox capacity: the sandbox's queue.
"""

from __future__ import annotations

from typing import Any

from kiln.policy import POLICIES

REPRODUCE_DAG_ID = "kiln_reproduce"
"""``kiln.provenance.reproduce.REPRODUCE_DAG_ID`` (not imported: this module imports ``kiln.policy`` only):
the reproduction DAG runs in sandbox capacity, so on the sandbox's queue."""
QUEUES: dict[str, str] = {
    dag_id: f"kiln-{policy.name}"
    for policy in POLICIES.values()
    for dag_id in (policy.dag_id, getattr(policy, "champion_watch_dag_id", None))
    if dag_id
} | {REPRODUCE_DAG_ID: "kiln-sandbox"}
"""Celery queue per policy DAG (``kiln-production``, ``kiln-sandbox``); other DAGs use ``default``."""


def task_policy(task: Any) -> None:
    """Airflow cluster policy: route a policy DAG's tasks to its policy's Celery queue."""
    queue = QUEUES.get(getattr(task, "dag_id", None) or "")
    if queue:
        task.queue = queue

"""Champion watch (Airflow DAG): re-evaluates the production champion on a schedule, proposes an alias rollback through a review.

Wiring only (the words "airflow" and "dag" in this file also let the dag-processor's safe mode pick it
up) — built by ``kiln.airflow.dagfactory`` from the production policy (``kiln.policy``); the stages are in
``kiln.stages.champion_watch``.
"""

from kiln.airflow.dagfactory import build_champion_watch_dag
from kiln.policy import PRODUCTION

dag = build_champion_watch_dag(PRODUCTION)

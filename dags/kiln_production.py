"""Regulated production retraining (Airflow DAG): scheduled and corpus-asset triggered, pinned inputs, human approval.

Wiring only (the words "airflow" and "dag" in this file also let the dag-processor's safe mode pick it
up) — the pipeline is built by ``kiln.airflow.dagfactory`` from the production policy (``kiln.policy``).
"""

from kiln.airflow.dagfactory import build_dag
from kiln.policy import PRODUCTION

dag = build_dag(PRODUCTION)

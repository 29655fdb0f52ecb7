"""Sandbox experiments: trigger from the Airflow UI form; registers only under sandbox model names.

Wiring only (the words "airflow" and "dag" in this file also let the dag-processor's safe mode pick it
up) — the pipeline is built by ``kiln.airflow.dagfactory`` from the sandbox policy (``kiln.policy``).
"""

from kiln.airflow.dagfactory import build_dag
from kiln.policy import SANDBOX

dag = build_dag(SANDBOX)

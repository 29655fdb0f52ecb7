"""Reproduce (Airflow DAG): ``kiln reproduce`` from the UI form, by hand, in sandbox capacity.

Wiring only (the words "airflow" and "dag" in this file also let the dag-processor's safe mode pick it
up) — built by ``kiln.airflow.dagfactory.build_reproduce_dag`` from the sandbox policy (``kiln.policy``);
the re-derivation is ``kiln.provenance.reproduce``.
"""

from kiln.airflow.dagfactory import build_reproduce_dag
from kiln.policy import SANDBOX

dag = build_reproduce_dag(SANDBOX)

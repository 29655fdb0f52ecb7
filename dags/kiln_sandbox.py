"""Sandbox experiments: trigger from the Airflow UI form; registers only under sandbox model names.

Wiring only — the pipeline is built by ``kiln.dagfactory`` from the sandbox policy (``kiln.policy``).
"""

from kiln.dagfactory import build_dag
from kiln.policy import SANDBOX

dag = build_dag(SANDBOX)

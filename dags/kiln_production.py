"""Regulated production retraining: scheduled and corpus-asset triggered, pinned inputs, human approval.

Wiring only — the pipeline is built by ``kiln.dagfactory`` from the production policy (``kiln.policy``).
"""

from kiln.dagfactory import build_dag
from kiln.policy import PRODUCTION

dag = build_dag(PRODUCTION)

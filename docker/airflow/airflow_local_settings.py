"""Airflow cluster policy of kiln's image (copied to $AIRFLOW_HOME/config/, which Airflow puts on sys.path).

The same file kiln.stack.prodlike writes (``kiln.stack.prodlike.LOCAL_SETTINGS``): route every DAG of a policy
(the retraining DAG and the champion watch) to that policy's Celery queue (kiln-production,
kiln-sandbox), served by a worker that holds only that policy's MLflow identity
(docker/compose.yaml, airflow-worker-production / airflow-worker-sandbox). ``kiln.cluster_policy``
imports nothing but ``kiln.policy``: every Airflow process loads this file.
"""

from kiln.cluster_policy import task_policy  # noqa: F401

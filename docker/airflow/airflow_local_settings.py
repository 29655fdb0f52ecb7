"""Airflow cluster policy of kiln's image (copied to $AIRFLOW_HOME/config/, which Airflow puts on sys.path).

The same file kiln.prodstack writes (``kiln.prodstack.LOCAL_SETTINGS``): route each policy DAG's tasks
to its own Celery queue (kiln-production, kiln-sandbox), served by a worker that holds only that
policy's MLflow identity (docker/compose.yaml, airflow-worker-production / airflow-worker-sandbox).
"""

from kiln.prodstack import task_policy  # noqa: F401

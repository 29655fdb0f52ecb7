"""Running kiln's own stacks on one machine: the services, their state and their identities.

    embedded        the default stack (``kiln stack up``, ``make demo``, most tests): Airflow on SQLite
                    with the LocalExecutor, an MLflow server, the signals exporter, under KILN_HOME
    prodlike        the production-like topology as plain processes (``--profile prodlike``):
                    PostgreSQL, Celery on Redis with a worker per policy, MLflow on PostgreSQL + S3
                    (a local moto server), basic-auth, FAB
    mlflow_server   starting and stopping an ``mlflow server`` (both stacks and the tests)
    airflow_client  the Airflow REST client the demo and the tests drive a stack with
    demo            ``make demo``: one production run, end to end, on the embedded stack

Nothing here runs in a deployment: a real one brings its own Airflow, MLflow and storage
(``docker/``, ``docs/production-stack.md``).
"""

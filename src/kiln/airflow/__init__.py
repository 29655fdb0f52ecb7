"""The Airflow adapters: the only modules of kiln that import Airflow.

    dagfactory   one factory builds every policy's DAG (tasks, operators, the review, callbacks)
    triggers     the deferrable trigger that polls a launched Slurm or Kubernetes job
    fab_auth     roles and users of the FAB auth manager (the production-like stack's per-DAG permissions)

Everything else in kiln is plain Python that these call: a DAG task builds a stage's inputs, calls
one library function and returns a small JSON reference.
"""

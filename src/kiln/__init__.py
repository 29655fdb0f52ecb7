"""kiln: a training factory on Apache Airflow 3 (orchestration-side library and CLI).

Never imports torch at module level, and Airflow only in ``kiln.airflow`` (the adapters: DAG factory,
trigger, auth); a test holds both rules. ``docs/architecture.md`` maps the packages to their concerns.
"""

__version__ = "0.1.0"

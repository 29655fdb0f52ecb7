"""kiln: a training factory on Apache Airflow 3 (orchestration-side library and CLI).

Never imports torch at module level, never airflow outside ``kiln.dagfactory``.
"""

__version__ = "0.1.0"

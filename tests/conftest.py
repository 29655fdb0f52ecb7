"""Test-wide isolation: no test touches the developer's .kiln/ or ~/airflow.

Set before anything imports airflow or kiln.settings reads the environment.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_STATE = Path(tempfile.mkdtemp(prefix="kiln-tests-"))
os.environ["KILN_HOME"] = str(_STATE / "kiln")
os.environ.setdefault("AIRFLOW_HOME", str(_STATE / "airflow"))
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(Path(__file__).resolve().parents[1] / "dags")
os.environ.setdefault("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{_STATE / 'airflow' / 'airflow.db'}")
os.environ["DVC_NO_ANALYTICS"] = "1"
os.environ["GIT_PYTHON_REFRESH"] = "quiet"
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("MLFLOW_RUN_ID", None)

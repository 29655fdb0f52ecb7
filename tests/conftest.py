"""Test-wide isolation: no test touches the developer's .kiln/ or ~/airflow.

Set before anything imports airflow or kiln.settings reads the environment.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

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


@pytest.fixture(autouse=True)
def _isolate_mlflow_global_tracking_uri():
    """Give every test mlflow's process-global tracking URI as it found it.

    ``mlflow.set_tracking_uri`` (which kiln.registry calls for the fluent API) outlives a test and
    beats MLFLOW_TRACKING_URI; a URI of a server a finished test stopped would make later tests
    retry against nothing for minutes. mlflow has no public "unset", hence the private attribute.
    """
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    before = getattr(utils, "_tracking_uri", None) if utils else None
    yield
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if utils is not None and hasattr(utils, "_tracking_uri"):
        utils._tracking_uri = before


def fill_disk(disk: Path) -> None:
    """Take every free block of ``disk`` (a file ``ballast``): the next write there gets ENOSPC."""
    fd = os.open(disk / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass  # ENOSPC: full
    finally:
        os.close(fd)


@pytest.fixture()
def tmpfs():
    """``tmpfs(size="256k", read_only=False) -> Path``: a real, small file system for the test, so a
    full or a read-only disk is the kernel's answer rather than a faked call; unmounted afterwards.
    ``tmpfs.fill(path)`` fills the one ``path`` is on."""
    import subprocess

    mounted: list[Path] = []

    def mount(size: str = "256k", *, read_only: bool = False) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (the test containers and CI run as root)")
        where = Path(tempfile.mkdtemp(prefix="kiln-tmpfs-"))
        options = f"size={size}" + (",ro" if read_only else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    mount.fill = fill_disk
    try:
        yield mount
    finally:
        for where in reversed(mounted):
            if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(where)], check=True)  # a process still inside
            where.rmdir()

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


_ONE_STACK_AT_A_TIME = ("e2e", "e2e_prodlike")
"""Packages whose tests run against a stack their package fixture starts (Airflow + MLflow on free
ports): under pytest-xdist all of them run in one worker, one after the other, as without it."""


def xdist_group_of(nodeid: str) -> str:
    """The unit of work pytest-xdist hands one worker (``-n N --dist loadgroup``): the stack packages
    as one ("stack": one stack at a time, started once, as in a serial run), any other test with its
    file, so a module fixture (a Slurm cluster, an MLflow server) starts once, not once per worker."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in _ONE_STACK_AT_A_TIME:
        return "stack"
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` schedules by ``xdist_group_of``. pytest-xdist's own loadgroup cannot be
    used: it passes each test's ``xdist_group`` mark to the scheduler as a node-id suffix, which
    pytest 9.2 no longer keeps (pytest-xdist issue 1386), so it silently spread the stack tests over
    the workers and each worker started its own stack."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneStackAtATime(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    config.option.loadscopereorder = False  # the stack first (the longest unit), as the workers order it
    return OneStackAtATime(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        # The stack's tests wait on Airflow most of the time: they start first, in the one worker
        # that gets them, and the rest of the suite (CPU-bound) runs in the other workers meanwhile.
        items.sort(key=lambda item: xdist_group_of(item.nodeid) != "stack")


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

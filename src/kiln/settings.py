"""Where the embedded stack keeps its state, and how to reach its services.

Everything is read from the environment at call time (never cached at import) so that tests can
point a process at their own stack. All state lives under ``KILN_HOME`` (default ``.kiln/`` in the
checkout, ``~/.kiln`` for an installed kiln); ``rm -rf .kiln`` resets the embedded stack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import ConfigError
from kiln.shipped import CHECKOUT, in_checkout


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    home: Path
    """Root of all embedded-stack state."""
    mlflow_uri: str
    """Tracking URI clients use (``MLFLOW_TRACKING_URI``, else the embedded server)."""
    mlflow_port: int
    """Port of the embedded MLflow server (``KILN_MLFLOW_PORT``)."""
    airflow_url: str
    signals_port: int
    """Port of the embedded Prometheus exporter of operational signals (``KILN_SIGNALS_PORT``)."""
    dvc_repo: Path
    """The DVC workspace (``no_scm``) that holds corpus snapshots."""
    dvc_remote: str
    """DVC remote URL: a local directory by default, ``s3://...`` for the production-like stack."""
    dvc_remote_endpoint: str | None
    """S3 endpoint URL (``KILN_DVC_REMOTE_ENDPOINT``; a moto server in tests). Credentials come only
    from the standard AWS_* environment / AWS config files or DVC's config outside the workspace."""
    dvc_hash_jobs: int = 1
    """Threads that hash files during a snapshot (``KILN_DVC_HASH_JOBS``; default: every core, at
    most 8). DVC's own default is half the cores, i.e. one thread on a 2-core machine, which makes
    a snapshot hash slower than ``md5sum``; md5 releases the GIL, so threads scale."""
    runs_dir: Path
    """Per-DAG-run working directories: training runs, reports, manifests."""
    corpus_root: Path
    """Registered corpora live here, inside the DVC workspace, one directory per corpus name."""

    @property
    def dvc_cache(self) -> Path:
        return self.home / "dvc-cache"

    @property
    def dvc_site_cache(self) -> Path:
        """DVC's state db (``inode, mtime, size -> md5``, what makes re-snapshots incremental) and
        index, kept with the rest of the stack instead of ``/var/tmp/dvc``."""
        return self.home / "dvc-site-cache"


def default_home() -> Path:
    """``.kiln/`` in the checkout kiln runs from; ``~/.kiln`` for an installed kiln (``KILN_HOME`` overrides both)."""
    return CHECKOUT / ".kiln" if in_checkout() else Path.home() / ".kiln"


def load() -> Settings:
    home = Path(os.environ.get("KILN_HOME") or default_home()).resolve()
    mlflow_port = os.environ.get("KILN_MLFLOW_PORT", "5000")
    airflow_port = os.environ.get("KILN_AIRFLOW_PORT", "8080")
    return Settings(
        home=home,
        mlflow_uri=os.environ.get("MLFLOW_TRACKING_URI") or f"http://127.0.0.1:{mlflow_port}",
        mlflow_port=int(mlflow_port),
        airflow_url=os.environ.get("KILN_AIRFLOW_URL", f"http://127.0.0.1:{airflow_port}"),
        signals_port=int(os.environ.get("KILN_SIGNALS_PORT", "9469")),
        dvc_repo=home / "dvc-repo",
        dvc_remote=os.environ.get("KILN_DVC_REMOTE", str(home / "dvc-remote")),
        dvc_remote_endpoint=os.environ.get("KILN_DVC_REMOTE_ENDPOINT") or None,
        dvc_hash_jobs=_positive_int("KILN_DVC_HASH_JOBS", min(8, os.cpu_count() or 1)),
        runs_dir=home / "runs",
        corpus_root=home / "dvc-repo" / "corpora",
    )


def _positive_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {raw!r}")
    return value


def restore_environ(saved: dict[str, str | None]) -> None:
    """Put environment variables back as ``saved`` recorded them (``None``: the variable was unset)."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

"""Helpers of the packaging tests: a clean copy of the checkout and kiln's wheels built from it.

Imported by the tests of this folder as ``wheel_builds`` (pytest puts a test file's folder on sys.path)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def clean_copy(dest: Path) -> Path:
    """The files git would commit (tracked, or new and not ignored), links kept as links."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src, dst = ROOT / name, dest / name
        if not src.is_symlink() and not src.is_file():
            continue  # deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)
    return dest


def build_wheel(project: Path, dist: Path, name: str) -> Path:
    """The wheel of the distribution ``name`` whose pyproject.toml is in ``project`` (a clean copy: the
    build writes build/ and *.egg-info into its source tree), written to ``dist``."""
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dist),
         str(project)], cwd=dist.parent, capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob(f"{name.replace('-', '_')}-*.whl")
    return wheel


def isolated_env(venv: Path, **extra: str) -> dict[str, str]:
    """This process's environment without its Python, kiln, Airflow and MLflow settings, with ``venv``'s
    bin first on PATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KILN_", "AIRFLOW", "MLFLOW"))}
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", **extra)
    return env

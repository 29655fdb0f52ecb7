"""The files kiln ships besides its code: the data contracts, the training recipes, the reviewed
policy configuration, the DAG files and the Airflow plugin — found in one place, in a checkout and
in an installed wheel alike.

``kiln/_shipped/`` holds links to the repository's own top-level folders (``data_contracts/``,
``training/recipes/``, ``training/mixtures/``, ``config/``, ``dags/``, ``plugins/``); a wheel build follows them and copies
the files in as package data. So an editable install reads the checkout, a plain ``pip install`` reads its copy,
and no code asks where the repository is.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "_shipped"
CONTRACTS_DIR = (SHIPPED / "data_contracts").resolve()
RECIPES_DIR = (SHIPPED / "recipes").resolve()
MIXTURES_DIR = (SHIPPED / "mixtures").resolve()
"""Data mixtures a run may name (``kiln.data.mixtures``): ``training/mixtures/<name>.toml``."""
CONFIG_DIR = (SHIPPED / "config").resolve()
"""Reviewed configuration: ``production.toml`` (the production policy's corpus, contract and model)."""
DAGS_DIR = (SHIPPED / "dags").resolve()
PLUGINS_DIR = (SHIPPED / "plugins").resolve()

CHECKOUT = Path(__file__).resolve().parents[2]
"""The repository root when kiln runs from a checkout (else: wherever the package is installed)."""


def in_checkout() -> bool:
    """True when kiln runs from its repository (an editable install), not from an installed copy."""
    return (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "src" / "kiln").is_dir()

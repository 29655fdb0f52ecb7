"""Shared, session-scoped sample corpora for the corpus / contract / validation tests.

Building a corpus reads the stdlib (~1.5 s) and GE costs ~3 s to import, so each corpus is built
once and the poisoned one is validated once; tests only read these results.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# The trainer tests' helpers (``trainer_fixtures``: real shards, TrainingManifests, the trainer's
# environment) serve the CLI tests of ``kiln train`` and ``kiln evaluate`` too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

from kiln.data.corpus import POISON_KINDS

ALL_POISONS = tuple(POISON_KINDS)
POISONED_SHARDS = 20
"""More shards than poison kinds, so some shards stay clean (and one can donate ids)."""


@pytest.fixture(scope="session")
def stdlib_contract():
    from kiln.data.contracts import load_contract

    return load_contract("stdlib-py@1")


@pytest.fixture(scope="session")
def clean_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kiln.data.corpus import build_corpus

    return build_corpus(tmp_path_factory.mktemp("clean") / "corpus")


@pytest.fixture(scope="session")
def poisoned_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kiln.data.corpus import build_corpus

    return build_corpus(tmp_path_factory.mktemp("poisoned") / "corpus", shards=POISONED_SHARDS, seed=7, poison=ALL_POISONS)


@pytest.fixture(scope="session")
def poisoned_reports(poisoned_corpus: dict[str, Any], stdlib_contract):
    from kiln.data.validation import validate_directory

    return validate_directory(poisoned_corpus["out"], stdlib_contract)


def _run_cli(argv: list[str]) -> int:
    from kiln.cli import corpus as corpus_cli
    from kiln.cli import validate as validate_cli

    parser = argparse.ArgumentParser(prog="kiln")
    sub = parser.add_subparsers(dest="command", required=True)
    corpus_cli.add_parser(sub)
    validate_cli.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


@pytest.fixture
def kiln_cli() -> Callable[[list[str]], int]:
    """A local ``kiln`` with only the corpus and validate subcommands: isolated from the other
    subcommands (the real ``kiln.cli.main`` registers them the same way, via ``add_parser``)."""
    return _run_cli


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """A throwaway KILN_HOME with the default (local) DVC remote."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    monkeypatch.delenv("KILN_DVC_REMOTE", raising=False)
    monkeypatch.delenv("KILN_DVC_REMOTE_ENDPOINT", raising=False)
    return tmp_path / "kiln"

"""The package layout's rules, as docs/architecture.md states them: Airflow is imported only by the
adapters in ``kiln.airflow``; the trainer never imports kiln or Airflow."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _importers(root: Path, top: str, *, allowed: Path | None = None) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: {name}"
            for path in sorted(root.rglob("*.py")) if "_shipped" not in path.parts
            and not (allowed and path.is_relative_to(allowed))
            for line, name in _imports(path) if name == top or name.startswith(f"{top}.")]


def test_airflow_is_imported_only_by_the_adapters_in_kiln_airflow():
    kiln = REPO / "src" / "kiln"
    assert _importers(kiln, "airflow", allowed=kiln / "airflow") == []
    assert _importers(kiln / "airflow", "airflow"), "the adapters import Airflow (else this test looks nowhere)"


def test_the_trainer_imports_neither_kiln_nor_airflow():
    trainer = REPO / "training" / "kiln_trainer"
    assert _importers(trainer, "kiln") == [] and _importers(trainer, "airflow") == []


def test_every_json_kiln_reads_goes_through_the_one_bounded_reader():
    """``json.load``/``json.loads`` recurse without a bound and read any size: kiln and its trainer call
    them only inside ``kiln_trainer.jsonfile``, which bounds size, depth and numbers first."""
    owner = REPO / "training" / "kiln_trainer" / "jsonfile.py"
    calls = []
    for root in (REPO / "src" / "kiln", REPO / "training" / "kiln_trainer"):
        for path in sorted(root.rglob("*.py")):
            if path == owner or "_shipped" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr in ("load", "loads")
                        and isinstance(node.value, ast.Name) and node.value.id == "json"):
                    calls.append(f"{path.relative_to(REPO)}:{node.lineno}: json.{node.attr}")
    assert not calls, "parse JSON with kiln_trainer.jsonfile (kiln.util.fs re-exports it):\n" + "\n".join(calls)

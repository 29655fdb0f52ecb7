"""docs/runbook.md stays true: one entry per alert rule (the rule's ``runbook`` annotation points at
it), and every test it cites as proof exists."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RUNBOOK = REPO / "docs" / "runbook.md"
RULES = REPO / "docker" / "prometheus" / "rules" / "kiln.rules.yml"


def _alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_has_a_runbook_entry_its_annotation_points_at():
    headings = set(re.findall(r"^## (\w+)\s*$", RUNBOOK.read_text(), flags=re.M))
    for rule in _alerts():
        assert rule["alert"] in headings, f"docs/runbook.md has no '## {rule['alert']}' entry"
        assert rule["annotations"]["runbook"] == f"docs/runbook.md#{rule['alert'].lower()}"


def test_every_cited_test_exists():
    """``tests/x.py::test_a`` and the shorthand ``::test_b`` (same file as the citation before it)."""
    text = RUNBOOK.read_text()
    cited, path = [], None
    for m in re.finditer(r"(tests/[\w/]+\.py)?::(test_\w+)", text):
        path = m.group(1) or path
        assert path, f"::{m.group(2)} cited before any test file"
        cited.append((path, m.group(2)))
    assert len(cited) > 20
    missing = [f"{p}::{name}" for p, name in cited
               if not (REPO / p).is_file() or not re.search(rf"^(async )?def {name}\(", (REPO / p).read_text(), flags=re.M)]
    assert not missing, f"docs/runbook.md cites tests that do not exist: {missing}"

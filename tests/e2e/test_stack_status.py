"""``kiln stack status`` on the real embedded stack: every service healthy, with its URL; Airflow's
scheduler, dag-processor and triggerer as the api-server's health endpoint reports their heartbeats."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]


def test_stack_status_shows_every_service_healthy_with_its_url(stack):
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "stack", "status"], capture_output=True, text=True,
                          env=os.environ.copy(), timeout=60, check=True)
    report = json.loads(proc.stdout)
    assert set(report) == {"mlflow", "api-server", "signals", "scheduler", "dag-processor", "triggerer"}
    for name, entry in report.items():
        assert isinstance(entry["pid"], int), (name, entry)
        assert entry["health"].startswith("healthy"), (name, entry)
    assert report["api-server"]["url"] == stack["airflow"] and report["mlflow"]["url"] == stack["mlflow"]
    assert report["signals"]["url"].endswith("/metrics")
    assert "last heartbeat" in report["scheduler"]["health"]

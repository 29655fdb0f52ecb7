"""``kiln stack status``: each service's pid, health (its health URL probed) and URL, against real
service processes (the signals exporter; moto for the production-like stack)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from kiln import settings as kiln_settings
from kiln.stack import embedded, prodlike
from kiln.util.net import free_port
from kiln.util.procs import end_process_group, record_start


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 60  # a safety net, not a timing assertion
    while True:
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"{url} never answered"
        time.sleep(0.1)


@pytest.fixture()
def started(home, monkeypatch) -> Iterator:
    """``started(pidfile, argv, health_url)``: a real service process recorded where ``status`` looks."""
    monkeypatch.setenv("KILN_SIGNALS_PORT", str(free_port()))
    monkeypatch.setenv("KILN_MLFLOW_PORT", str(free_port()))
    monkeypatch.setenv("KILN_AIRFLOW_PORT", str(free_port()))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    procs: list[subprocess.Popen] = []

    def start(pidfile: Path, argv: list[str], health_url: str, env: dict[str, str] | None = None) -> int:
        home.mkdir(parents=True, exist_ok=True)
        pidfile.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(argv, cwd=home, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        procs.append(proc)
        record_start(pidfile, proc.pid, home)
        _wait_healthy(health_url)
        return proc.pid

    yield start
    for proc in procs:
        end_process_group(proc.pid, 10, reap=proc)


def _signals_argv(port: int) -> list[str]:
    return [str(Path(sys.executable).with_name("kiln")), "signals", "serve", "--port", str(port)]


def test_embedded_status_shows_health_and_url_of_each_service(started):
    s = kiln_settings.load()
    pid = started(embedded._pidfile(s, "signals"), _signals_argv(s.signals_port), f"http://127.0.0.1:{s.signals_port}/healthz")
    report = embedded.status()
    assert report["signals"] == {"pid": pid, "health": "healthy", "url": f"http://127.0.0.1:{s.signals_port}/metrics"}
    assert report["api-server"] == {"pid": None, "health": "down", "url": s.airflow_url}
    assert report["mlflow"] == {"pid": None, "health": "down", "url": s.mlflow_uri}
    assert {report[name]["health"] for name in ("scheduler", "dag-processor", "triggerer")} == {"down"}

    cli = subprocess.run([sys.executable, "-m", "kiln.cli", "stack", "status"], capture_output=True, text=True,
                         env=os.environ.copy(), check=True)
    assert json.loads(cli.stdout)["signals"]["health"] == "healthy"


def test_a_running_service_that_does_not_answer_its_health_url_is_unhealthy(started, monkeypatch):
    s = kiln_settings.load()
    elsewhere = free_port()  # the process runs, but not where the stack's settings say it answers
    started(embedded._pidfile(s, "signals"), _signals_argv(elsewhere), f"http://127.0.0.1:{elsewhere}/healthz")
    health = embedded.status()["signals"]["health"]
    assert health.startswith(f"unhealthy: no answer at http://127.0.0.1:{s.signals_port}/healthz"), health


def test_prodlike_status_shows_health_and_url_of_each_service(started, monkeypatch):
    s = kiln_settings.load()
    monkeypatch.setattr(prodlike, "_free_redis_db", lambda: 7)  # state only: no Redis is touched
    st = prodlike.state(s, create=True)
    moto = next(svc for svc in prodlike.services(s, st) if svc.name == "moto")
    pid = started(prodlike._pidfile(s, "moto"), moto.argv, moto.health_url, moto.env)
    report = prodlike.status()
    assert report["moto"] == {"pid": pid, "health": "healthy", "url": prodlike._s3_endpoint(st)}
    assert report["mlflow"] == {"pid": None, "health": "down", "url": f"http://127.0.0.1:{s.mlflow_port}"}
    assert report["api-server"]["url"] == s.airflow_url and report["api-server"]["health"] == "down"
    assert report["worker-production"] == {"pid": None, "health": "down", "url": None}

"""kiln.tracking, the one place a DAG run's MLflow run is found or created and given its status,
against a real ``mlflow server`` (fixture in conftest.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kiln import tracking
from kiln.errors import ConfigError
from kiln.policy import SANDBOX
from kiln.runs import RUN_KEY_TAG, experiment_name

pytestmark = pytest.mark.slow


def test_a_run_key_finds_the_run_it_made_and_later_stages_add_their_tags(mlflow_uri: str, unique_name: str) -> None:
    client = tracking.tracking_client()
    key = f"kiln_sandbox/{unique_name}"
    first, created = tracking.find_or_create_run(client, SANDBOX, key, run_name="first", tags={"kiln.a": "1"})
    again, created_again = tracking.find_or_create_run(client, SANDBOX, key, run_name="ignored", tags={"kiln.b": "2"})
    assert (again, created, created_again) == (first, True, False)
    run = client.get_run(first)
    assert run.data.tags[RUN_KEY_TAG] == key and run.data.tags["kiln.a"] == "1" and run.data.tags["kiln.b"] == "2"
    assert run.info.run_name == "first"
    assert client.get_experiment(run.info.experiment_id).name == experiment_name(SANDBOX)
    other, created_other = tracking.find_or_create_run(client, SANDBOX, f"{key}-2", run_name="other")
    assert created_other and other != first  # a key that only starts like another one finds its own run


def test_status_is_set_terminal_or_put_back(mlflow_uri: str, unique_name: str) -> None:
    client = tracking.tracking_client()
    run_id, _ = tracking.find_or_create_run(client, SANDBOX, f"kiln_sandbox/{unique_name}", run_name="s")
    tracking.set_run_status(client, run_id, "FINISHED")
    finished = client.get_run(run_id).info
    assert finished.status == "FINISHED" and finished.end_time
    tracking.set_run_status(client, run_id, "RUNNING")
    assert client.get_run(run_id).info.status == "RUNNING"
    tracking.set_run_status(client, run_id, "FAILED")
    assert client.get_run(run_id).info.status == "FAILED"


def test_a_run_key_mlflow_cannot_search_for_is_refused_before_any_request(mlflow_uri: str) -> None:
    with pytest.raises(ConfigError, match="quotes"):
        tracking.find_or_create_run(tracking.tracking_client(), SANDBOX, "kiln_sandbox/it's", run_name="x")


def test_no_other_module_creates_an_mlflow_run_or_sets_its_status() -> None:
    src = Path(__file__).resolve().parents[2] / "src" / "kiln"
    found = []
    for path in sorted(src.rglob("*.py")):
        if path.name == "tracking.py" or "_shipped" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            if name in ("create_run", "set_terminated", "start_run", "end_run") or (
                    name == "update_run" and any(k.arg == "status" for k in node.keywords)):
                found.append(f"{path.relative_to(src)}:{node.lineno}: {name}")
    assert not found, "MLflow runs made or ended outside kiln.tracking:\n" + "\n".join(found)

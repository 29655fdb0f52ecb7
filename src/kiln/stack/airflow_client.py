"""A small client of Airflow 3's public REST API (``/api/v2``), as the UI and operators use it.

HTTP only (no ``airflow`` import): the demo, the end-to-end tests and the CLI talk to a running
api-server exactly like a person's browser does, including answering a HITL approval through the
same endpoint as the UI's "Required actions" page.
"""

from __future__ import annotations

import json
import time
from typing import Any

import requests

from kiln.errors import AirflowAPIError
from kiln.util.fs import parse_own_json


class AirflowClient:
    def __init__(self, base_url: str, username: str, password: str, *, timeout: float = 30.0):
        self.base = base_url.rstrip("/")
        self.username = username
        self._password = password
        self.timeout = timeout
        self._session = requests.Session()
        self._token: str | None = None

    # ------------------------------------------------------------------ plumbing
    def _login(self) -> None:
        resp = self._session.post(
            f"{self.base}/auth/token", json={"username": self.username, "password": self._password}, timeout=self.timeout
        )
        if resp.status_code not in (200, 201):
            raise AirflowAPIError(f"login as {self.username!r} failed: HTTP {resp.status_code} {resp.text[:200]}",
                                  resp.status_code)
        self._token = resp.json()["access_token"]

    def request(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any) -> Any:
        if self._token is None:
            self._login()
        extra_headers = kwargs.pop("headers", {})
        for attempt in (1, 2):
            resp = self._session.request(
                method, f"{self.base}/api/v2{path}", headers={**extra_headers, "Authorization": f"Bearer {self._token}"},
                timeout=self.timeout, **kwargs,
            )
            if resp.status_code == 401 and attempt == 1:  # token expired
                self._login()
                continue
            break
        if resp.status_code not in ok:
            raise AirflowAPIError(f"{method} {path} as {self.username!r}: HTTP {resp.status_code} {resp.text[:500]}",
                                  resp.status_code)
        return resp.json() if resp.content else None

    # ------------------------------------------------------------------ dags and runs
    def get_dag(self, dag_id: str) -> dict[str, Any]:
        return self.request("GET", f"/dags/{dag_id}")

    def wait_for_dag(self, dag_id: str, timeout: float = 120.0) -> dict[str, Any]:
        """Wait until the dag-processor has parsed ``dag_id``; fail fast with its import error."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.get_dag(dag_id)
            except AirflowAPIError as exc:
                if exc.status != 404:
                    raise
            errors = self.request("GET", "/importErrors").get("import_errors", [])
            if errors and time.monotonic() > deadline - timeout / 2:
                raise AirflowAPIError(
                    "DAG import errors: " + "; ".join(e["filename"] + ": " + e["stack_trace"][-400:] for e in errors)
                )
            if time.monotonic() > deadline:
                raise AirflowAPIError(f"DAG {dag_id} did not appear within {timeout:.0f}s")
            time.sleep(1)

    def unpause(self, dag_id: str) -> None:
        self.request("PATCH", f"/dags/{dag_id}", json={"is_paused": False})

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None, run_id: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"logical_date": None, "conf": conf or {}}
        if run_id:
            body["dag_run_id"] = run_id
        return self.request("POST", f"/dags/{dag_id}/dagRuns", json=body, ok=(200, 201))

    def get_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}")

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 1000})["task_instances"]

    def xcom(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1, key: str = "return_value") -> Any:
        data = self.request(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}", params={"map_index": map_index}
        )
        value = data["value"]
        if isinstance(value, str):
            try:
                return parse_own_json(value, "an Airflow variable")
            except ValueError:
                return value
        return value

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1, map_index: int = -1) -> str:
        data = self.request(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
            params={"map_index": map_index, "full_content": "true"}, headers={"Accept": "application/json"},
        )
        content = data.get("content") if isinstance(data, dict) else data
        if not isinstance(content, list):
            return str(content)
        lines = []
        for entry in content:
            if not isinstance(entry, dict):
                lines.append(str(entry))
                continue
            lines.append(str(entry.get("event", json.dumps(entry))))
            for err in entry.get("error_detail") or []:  # structured exceptions: type and message
                lines.append(f"  {err.get('exc_type')}: {err.get('exc_value')}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ human in the loop
    def hitl_detail(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict[str, Any]:
        return self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/hitlDetails")

    def answer_hitl(
        self, dag_id: str, run_id: str, task_id: str, options: list[str], params_input: dict[str, Any] | None = None,
        map_index: int = -1,
    ) -> dict[str, Any]:
        """Answer a HITL task through the endpoint the UI's Required Actions page uses."""
        return self.request(
            "PATCH", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/hitlDetails",
            json={"chosen_options": options, "params_input": params_input or {}},
        )

"""A real embedded stack for end-to-end tests: Airflow scheduler + api-server + dag-processor +
triggerer and an MLflow server, under a throwaway KILN_HOME on free ports. Started once for the
e2e package and stopped after it, so it never loads the machine during other tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.settings import restore_environ
from kiln.util.net import free_port

PRODUCTION_CONFIG = Path(__file__).resolve().parent / "production.toml"
"""The test deployment's reviewed production config: the shipped one with the 60-step staging recipe
pinned (``KILN_PRODUCTION_CONFIG``), so each production run trains 60 steps, not 300."""


@pytest.fixture(scope="package")
def stack(tmp_path_factory) -> Iterator[dict[str, str]]:
    from kiln.stack import embedded as kiln_stack

    home: Path = tmp_path_factory.mktemp("e2e") / "kiln"
    saved = {k: os.environ.get(k)
             for k in ("KILN_HOME", "KILN_AIRFLOW_PORT", "KILN_MLFLOW_PORT", "KILN_SIGNALS_PORT", "MLFLOW_TRACKING_URI",
                       "KILN_PRODUCTION_CONFIG")}
    os.environ["KILN_HOME"] = str(home)
    os.environ["KILN_PRODUCTION_CONFIG"] = str(PRODUCTION_CONFIG)
    os.environ["KILN_AIRFLOW_PORT"] = str(free_port())
    os.environ["KILN_MLFLOW_PORT"] = str(free_port())
    os.environ["KILN_SIGNALS_PORT"] = str(free_port())
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        info = kiln_stack.up(timeout=240, quiet=True)
        os.environ["MLFLOW_TRACKING_URI"] = info["mlflow"]
        yield info
    finally:
        try:
            kiln_stack.down()
        finally:
            restore_environ(saved)


@pytest.fixture(scope="package")
def deployed_production():
    """The production policy as the stack's processes build it (from ``PRODUCTION_CONFIG``), for a
    test that runs production's stages in-process: the versions it registers record the deployment's
    config, as the stack's do (``kiln.policy`` in this process read the shipped one at import)."""
    from kiln.policy import PRODUCTION, build_production_policy, load_production_config

    policy = build_production_policy(load_production_config(PRODUCTION_CONFIG))
    assert policy.config is not None and policy.config.values() != PRODUCTION.config.values()  # type: ignore[union-attr]
    return policy


@pytest.fixture(scope="package")
def admin(stack):
    from kiln.stack import embedded as kiln_stack
    from kiln.stack.airflow_client import AirflowClient

    return AirflowClient(stack["airflow"], "admin", kiln_stack.passwords()["admin"])


@pytest.fixture(scope="package")
def login(stack):
    """``login(user)`` -> an AirflowClient for one of the stack's users (reviewer, sandbox-user, …)."""
    from kiln.stack import embedded as kiln_stack
    from kiln.stack.airflow_client import AirflowClient

    return lambda user: AirflowClient(stack["airflow"], user, kiln_stack.passwords()[user])


@pytest.fixture(scope="package")
def llama_sandbox_run(stack, admin) -> dict[str, str]:
    """One finished sandbox run of a team's own model on a data mixture, shared by the tests that need
    a run of the sandbox DAG and not a particular trainer or corpus (so the package pays for one run,
    not one each): the form's ``tiny-llama.toml`` (the worked example of a trainer of your own, a
    Hugging Face ``LlamaForCausalLM`` on kiln's trainer SDK), 20 steps, on the form's mixture
    ``code-and-prose``: a fresh build of the sandbox's corpus with one poisoned shard (under
    stdlib-py@1) and the demo's prose corpus (under web-text@1). ``{"run_id", "poisoned"}`` (the
    quarantined shard's file name)."""
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import SANDBOX
    from kiln.stack.demo import build_prose_corpus, follow_run

    s = kiln_settings.load()
    built = build_corpus(s.corpus_root / SANDBOX.corpus, shards=4, seed=21, poison=("null_text",))
    (poisoned,) = [Path(p).name for p in built["poisoned"]]
    build_prose_corpus()
    admin.wait_for_dag(SANDBOX.dag_id)
    admin.unpause(SANDBOX.dag_id)
    conf = {"recipe": "tiny-llama.toml", "max_steps": 20, "seed": 2, "mixture": "code-and-prose"}
    run_id = admin.trigger(SANDBOX.dag_id, conf=conf)["dag_run_id"]
    final = follow_run(admin, SANDBOX.dag_id, run_id, timeout=780, progress=print)
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(SANDBOX.dag_id, run_id)}
    assert final["state"] == "success", states
    return {"run_id": run_id, "poisoned": poisoned}

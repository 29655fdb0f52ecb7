"""A DAG run's MLflow run, in one place: found by its run key or created once, and given its status.

Every stage of a DAG run logs into one MLflow run in its policy's experiment
(``kiln.runs.experiment_name``), tagged with the run key (``kiln.runs.RUN_KEY_TAG``). The data gate
and the train stage find or create it, registration does when no training run exists, and the
train stage and registration settle its status. Nothing else in kiln calls ``create_run``,
``set_terminated``, ``update_run(status=...)`` or the fluent ``start_run``/``end_run``. (The Airflow
plugin's links find the run over plain REST, ``kiln.links``, with the same experiment and tag.)

``client`` is whatever MlflowClient the caller acts through: the registry passes its own, whose
errors it translates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kiln import runs

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from kiln.policy import Policy

TERMINAL = ("FINISHED", "FAILED", "KILLED")


def tracking_client() -> MlflowClient:
    """An MlflowClient for the tracking server ``kiln.settings`` names."""
    from mlflow import MlflowClient

    from kiln import settings as kiln_settings

    return MlflowClient(tracking_uri=kiln_settings.load().mlflow_uri)


def experiment_id(client: MlflowClient, policy: Policy) -> str:
    """The policy's experiment, created the first time it is asked for."""
    name = runs.experiment_name(policy)
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(name)


def find_or_create_run(client: MlflowClient, policy: Policy, run_key: str, *, run_name: str,
                       tags: dict[str, str] | None = None) -> tuple[str, bool]:
    """``(run id, created)``: the MLflow run tagged with ``run_key`` in the policy's experiment, or a
    new one named ``run_name``. ``tags`` are set either way (a later stage adds what it knows; setting
    a tag again is idempotent)."""
    exp_id = experiment_id(client, policy)
    found = client.search_runs([exp_id], filter_string=runs.run_key_filter(run_key), max_results=1)
    if found:
        run_id = found[0].info.run_id
        for key, value in (tags or {}).items():
            client.set_tag(run_id, key, value)
        return run_id, False
    run = client.create_run(exp_id, run_name=run_name, tags={runs.RUN_KEY_TAG: run_key, **(tags or {})})
    return run.info.run_id, True


def set_run_status(client: MlflowClient, run_id: str, status: str) -> None:
    """A terminal status through ``set_terminated`` (which stamps the end time), any other (a run
    resumed to RUNNING, or put back as it was) through ``update_run``."""
    if status in TERMINAL:
        client.set_terminated(run_id, status)
    else:
        client.update_run(run_id, status=status)


@contextlib.contextmanager
def resumed(run_id: str) -> Iterator[None]:
    """The run, active for the fluent API for the block (``mlflow.<flavor>.log_model`` logs into the
    active run). Resuming and leaving change its status (RUNNING, then FINISHED): a caller that does
    not own the run puts back the one it had, with ``set_run_status``."""
    import mlflow

    with mlflow.start_run(run_id=run_id):
        yield

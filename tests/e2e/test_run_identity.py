"""Run identities under a real scheduler: run ids that differ only in characters a sanitiser would
replace are three runs (three run directories, three trainings, three registered weights), and a
run id Airflow cannot serve is refused when it is triggered, with a 400 that names the rule."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1500)]

COLLIDING = {"probe:col": 1, "probe_col": 2, "probe+col": 3}
"""Run id → the seed it trains with (one recipe, one corpus: only the seed tells the weights apart)."""


def _sandbox_ready(admin):
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import SANDBOX

    # The corpus test_sandbox_dag builds (same arguments: rebuilding it on a shared stack is a no-op).
    build_corpus(kiln_settings.load().corpus_root / SANDBOX.corpus, shards=6, seed=3,
                 poison=("garbage_bytes", "eval_contamination"))
    admin.wait_for_dag(SANDBOX.dag_id)
    admin.unpause(SANDBOX.dag_id)
    return SANDBOX


@pytest.mark.parametrize("run_id", [".", "r" * 251, "probe\n"])
def test_a_run_id_airflow_cannot_serve_is_refused_when_triggered(stack, admin, run_id):
    from kiln.errors import AirflowAPIError

    sandbox = _sandbox_ready(admin)
    with pytest.raises(AirflowAPIError) as info:
        admin.trigger(sandbox.dag_id, conf={"recipe": "tiny.toml", "max_steps": 20}, run_id=run_id)
    assert info.value.status == 400 and "does not match regex pattern" in str(info.value), str(info.value)
    runs = admin.request("GET", f"/dags/{sandbox.dag_id}/dagRuns", params={"limit": 100})["dag_runs"]
    assert run_id not in {r["dag_run_id"] for r in runs}


def test_run_ids_that_differ_only_in_replaced_characters_train_and_register_their_own_weights(stack, admin):
    """About 1.5 min on 2 cores: three sandbox runs, one after the other (the first must end before
    the others start: that order is the bug it guards against)."""
    import mlflow

    from kiln import runs
    from kiln.stack.demo import follow_run

    sandbox = _sandbox_ready(admin)
    first, *later = COLLIDING

    def trigger(run_id: str) -> str:
        conf = {"recipe": "tiny.toml", "max_steps": 20, "seed": COLLIDING[run_id]}
        return admin.trigger(sandbox.dag_id, conf=conf, run_id=run_id)["dag_run_id"]

    # The first run finishes before the others start: they are the "later runs" that once found its
    # result.json in their (shared) directory and trained nothing.
    ended = {first: follow_run(admin, sandbox.dag_id, trigger(first), timeout=600, progress=print)}
    for run_id in [trigger(r) for r in later]:
        ended[run_id] = follow_run(admin, sandbox.dag_id, run_id, timeout=600, progress=print)
    states = {r: {ti["task_id"]: ti["state"] for ti in admin.task_instances(sandbox.dag_id, r)} for r in COLLIDING}
    assert {r: run["state"] for r, run in ended.items()} == dict.fromkeys(COLLIDING, "success"), states

    train = {r: admin.xcom(sandbox.dag_id, r, "train") for r in COLLIDING}
    weights = {r: t["weights_sha256"] for r, t in train.items()}
    assert len(set(weights.values())) == 3, f"runs share trained weights: {weights}"

    homes = {r: runs.existing_run_dir(runs.run_key(sandbox.dag_id, r)) for r in COLLIDING}
    assert None not in homes.values() and len(set(homes.values())) == 3, homes
    for run_id, home in homes.items():
        assert runs.read_identity(home) == runs.RunIdentity(sandbox.dag_id, run_id)
        assert train[run_id]["run_dir"] == str(home / runs.TRAIN_SUBDIR)
        report = json.loads((home / runs.EVAL_REPORT).read_text())
        assert report["weights_sha256"] == weights[run_id], f"{run_id}'s eval report is of other weights"
        assert json.loads((home / runs.SUMMARY).read_text())["run_id"] == run_id

    client = mlflow.MlflowClient(tracking_uri=stack["mlflow"])
    registered = {}
    for run_id in COLLIDING:
        candidate = admin.xcom(sandbox.dag_id, run_id, "register_candidate")
        mv = client.get_model_version(candidate["model_name"], candidate["version"])
        assert mv.tags["kiln.airflow.run_id"] == run_id and mv.tags["kiln.run_key"] == f"{sandbox.dag_id}/{run_id}"
        registered[run_id] = (mv.version, mv.tags["kiln.weights_sha256"])
    assert {r: w for r, (_, w) in registered.items()} == weights, "a version's weights are another run's"
    assert len({v for v, _ in registered.values()}) == 3
    champion = client.get_model_version_by_alias(sandbox.target_model, sandbox.alias)
    assert champion.tags["kiln.weights_sha256"] == weights[champion.tags["kiln.airflow.run_id"]]

"""Where a reproduction's verdict is recorded under MLflow's basic auth (the ``kiln_reproduce`` DAG's identity).

A real ``mlflow server --app-name basic-auth``, provisioned by ``kiln.mlflow_auth`` as the production-like
stacks provision theirs (test_mlflow_permissions' fixtures: its own server, not the session's open one).
The sandbox identity reproduces a production version: it may write the ``kiln-sandbox`` experiment and only
read production's models, so ``record_verdict`` logs the signed attestation to the sandbox run, the registry
refuses the version's tags (403), and the reproduction does not fail; ``reproductions_of`` and
``verdict_lines`` find the verdict there. A sandbox version gets its tags as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
from test_mlflow_permissions import (  # noqa: F401  (fixtures)
    PROD_USER,
    SANDBOX_USER,
    SOURCE,
    AuthServer,
    as_user,
    auth_server,
    provisioned,
)

from kiln.errors import PolicyError
from kiln.mlflow_auth import MlflowIdentity, use_identity
from kiln.policy import PRODUCTION_MODEL, SANDBOX
from kiln.provenance.attestation import (
    NOT_ON_VERSION,
    REPRODUCTION_OF_TAG,
    record_verdict,
    reproductions_of,
    verdict_lines,
    verify_attestation,
)
from kiln.provenance.reproduce import Reproduction

pytestmark = pytest.mark.slow


@pytest.fixture
def reproducer(provisioned: AuthServer, as_user: Callable, tmp_path: Path,  # noqa: F811
               monkeypatch: pytest.MonkeyPatch) -> Callable:
    """``reproducer(user, model, verdict)``: record a verdict on a new version of ``model`` as ``user`` (kiln's
    own client, as the DAG's task makes it); returns the version, the outcome and the model directory."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", provisioned.url)
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "0")
    owner = {PRODUCTION_MODEL: PROD_USER, SANDBOX.target_model: SANDBOX_USER}

    def run(user: str, model: str, verdict: str, run_key: str, version: str | None = None):
        if version is None:
            with as_user(owner[model]) as client:
                version = client.create_model_version(model, SOURCE).version
        model_dir = tmp_path / f"{model}-{version}"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "provenance.dsse.json").write_text('{"payload": "the version\'s signed statement"}\n')
        workdir = tmp_path / f"work-{run_key.replace('/', '_')}"
        workdir.mkdir(exist_ok=True)
        outcome = Reproduction(model=model, version=str(version), policy="production", verdict=verdict,  # type: ignore[arg-type]
                               reason="" if verdict == "reproduced" else "train: weights sha256 differs: recorded a, "
                                                                          "re-derived b",
                               workdir=str(workdir), started_on="2026-12-07T16:00:00Z",
                               finished_on="2026-12-07T16:05:00Z")
        with as_user(user) as client:
            mv = client.get_model_version(model, version)
        with use_identity(MlflowIdentity(user, provisioned.passwords[user], source="test")):
            return mv, record_verdict(mv, outcome, model_dir, run_key), model_dir

    return run


def test_a_production_version_s_verdict_is_recorded_in_the_sandbox_run_when_its_tags_are_refused(
        reproducer: Callable, as_user: Callable, tmp_path: Path) -> None:  # noqa: F811
    import mlflow

    mv, outcome, model_dir = reproducer(SANDBOX_USER, PRODUCTION_MODEL, "differs", "kiln_reproduce/manual__p1")
    run_id = outcome.attestation_uri.removeprefix("runs:/").split("/")[0]
    assert outcome.attestation_uri == f"runs:/{run_id}/reproduction/reproduction.dsse.json"
    (note,) = [n for n in outcome.notes if n.startswith(NOT_ON_VERSION)]
    assert "'kiln-sandbox' (403 PERMISSION_DENIED)" in note
    assert f"MLflow run {run_id} of experiment kiln-sandbox" in note
    assert f"{REPRODUCTION_OF_TAG} = {PRODUCTION_MODEL}/{mv.version}" in note
    with as_user(PROD_USER) as client:  # nothing was written on the production version
        tags = client.get_model_version(PRODUCTION_MODEL, mv.version).tags
        assert not [k for k in tags if k.startswith("kiln.reproduction.")], tags
        run = client.get_run(run_id)
        assert client.get_experiment(run.info.experiment_id).name == "kiln-sandbox"
        assert run.data.tags[REPRODUCTION_OF_TAG] == f"{PRODUCTION_MODEL}/{mv.version}"
        assert run.data.tags["kiln.reproduction.verdict"] == "differs"
        assert run.data.tags["kiln.run_key"] == "kiln_reproduce/manual__p1"
        (found,) = reproductions_of(client, PRODUCTION_MODEL, mv.version)
        assert (found.run_id, found.verdict, found.attestation_uri, found.attestation_sha256) == (
            run_id, "differs", outcome.attestation_uri, outcome.attestation_sha256)
        assert found.detail.startswith("train: weights sha256 differs") and found.at == "2026-12-07T16:05:00Z"
        (line,) = verdict_lines(client, client.get_model_version(PRODUCTION_MODEL, mv.version))
        assert f"MLflow run {run_id} of experiment kiln-sandbox, not on the version's tags" in line
        assert "differs at 2026-12-07T16:05:00Z" in line
        mlflow.set_tracking_uri(client.tracking_uri)
        path = Path(mlflow.artifacts.download_artifacts(artifact_uri=outcome.attestation_uri,
                                                        dst_path=str(tmp_path / "download")))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == outcome.attestation_sha256
    statement = verify_attestation(path)  # signed with sandbox's key
    assert statement["predicate"]["verdict"] == "differs"
    assert statement["subject"][0]["digest"]["sha256"] == hashlib.sha256(
        (model_dir / "provenance.dsse.json").read_bytes()).hexdigest()

    # A retry of the same DAG run (same run key) finds the same run; still nothing on the version.
    _, again, _ = reproducer(SANDBOX_USER, PRODUCTION_MODEL, "differs", "kiln_reproduce/manual__p1", mv.version)
    assert again.attestation_uri == outcome.attestation_uri
    with as_user(PROD_USER) as client:
        assert [r.run_id for r in reproductions_of(client, PRODUCTION_MODEL, mv.version)] == [run_id]


def test_a_sandbox_version_gets_its_tags_and_no_note(reproducer: Callable, as_user: Callable) -> None:  # noqa: F811
    mv, outcome, _ = reproducer(SANDBOX_USER, SANDBOX.target_model, "reproduced", "kiln_reproduce/manual__s1")
    assert not [n for n in outcome.notes if n.startswith(NOT_ON_VERSION)]
    with as_user(SANDBOX_USER) as client:
        version = client.get_model_version(SANDBOX.target_model, mv.version)
        assert version.tags["kiln.reproduction.verdict"] == "reproduced"
        assert version.tags["kiln.reproduction.attestation"] == outcome.attestation_uri
        (line,) = verdict_lines(client, version)
        assert line.startswith("reproduction (version tags, not checked here): reproduced at 2026-12-07T16:05:00Z")
        fresh = client.create_model_version(SANDBOX.target_model, SOURCE)
        (line,) = verdict_lines(client, fresh)
        assert line.startswith("reproduction: none recorded")


def test_the_production_identity_cannot_record_a_reproduction_at_all(reproducer: Callable) -> None:
    """Reproductions are the sandbox's: the production identity only reads the sandbox experiment, so the
    run is refused (403) before any tag, and the refusal stands."""
    with pytest.raises(PolicyError, match="'kiln-production' .403 PERMISSION_DENIED"):
        reproducer(PROD_USER, PRODUCTION_MODEL, "reproduced", "kiln_reproduce/manual__x1")

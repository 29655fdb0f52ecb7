"""The promotion gate (``kiln.registry.decide``) and the registry's no-request refusals.

``decide`` is pure: these tests need no server. The refusal tests prove that a policy violation or a
held decision is refused before any MLflow request (the client factory is made to explode).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys

import pytest

from kiln import registry
from kiln.errors import ConfigError, PolicyError, RegistryError
from kiln.policy import PRODUCTION, PRODUCTION_MODEL, SANDBOX, GatePolicy
from kiln.refs import Decision, EvalReport
from kiln.runs import RUN_KEY_TAG, split_run_key

GATE = GatePolicy(max_bits_per_byte=7.5, max_regression=0.05)


def report(bpb: float = 3.0, *, split: str = "eval", loss: float | None = None, tokens: int = 4096) -> EvalReport:
    return EvalReport(
        checkpoint="/runs/x/checkpoints/step-00000010",
        weights_sha256="ab" * 32,
        split=split,
        bits_per_byte=bpb,
        loss=bpb * math.log(2) if loss is None else loss,
        tokens=tokens,
    )


def failed(decision: Decision) -> list[str]:
    return [r for r in decision.reasons if " FAILED: " in r]


# ------------------------------------------------------------------------------------------ decide


def test_first_model_within_threshold_is_promoted_with_reasons():
    decision = registry.decide(report(3.0), None, GATE)
    assert decision.action == "promote"
    assert decision.candidate_bits_per_byte == 3.0 and decision.champion_bits_per_byte is None
    # Every check says why it passed, so a reviewer reads the same list for promote and hold.
    assert [r.split(" ")[0] for r in decision.reasons] == [
        "sanity.split", "sanity.finite", "sanity.tokens", "threshold", "regression",
    ]
    assert all(" passed: " in r for r in decision.reasons)
    assert any("first model" in r for r in decision.reasons)


def test_better_than_champion_is_promoted():
    decision = registry.decide(report(2.9), report(3.0), GATE)
    assert decision.action == "promote"
    assert decision.champion_bits_per_byte == 3.0
    assert any("change -0.1000" in r for r in decision.reasons)


def test_regression_within_tolerance_is_promoted():
    assert registry.decide(report(3.04), report(3.0), GATE).action == "promote"


def test_regression_beyond_tolerance_is_held():
    decision = registry.decide(report(3.2), report(3.0), GATE)
    assert decision.action == "hold"
    assert [r.split(" ")[0] for r in failed(decision)] == ["regression"]
    assert "tolerance +0.0500" in failed(decision)[0]


def test_above_absolute_threshold_is_held_even_without_champion():
    decision = registry.decide(report(7.6), None, GATE)
    assert decision.action == "hold"
    assert [r.split(" ")[0] for r in failed(decision)] == ["threshold"]


def test_wrong_split_is_held():
    decision = registry.decide(report(2.0, split="train"), None, GATE)
    assert decision.action == "hold"
    assert "'train'" in failed(decision)[0] and failed(decision)[0].startswith("sanity.split")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_metrics_are_held(bad):
    decision = registry.decide(report(bad), report(3.0), GATE)
    assert decision.action == "hold"
    names = [r.split(" ")[0] for r in failed(decision)]
    assert "sanity.finite" in names and "threshold" in names and "regression" in names


def test_non_finite_loss_alone_is_held():
    decision = registry.decide(report(3.0, loss=float("nan")), None, GATE)
    assert decision.action == "hold"
    assert [r.split(" ")[0] for r in failed(decision)] == ["sanity.finite"]


def test_no_evaluation_tokens_is_held():
    decision = registry.decide(report(3.0, tokens=0), None, GATE)
    assert [r.split(" ")[0] for r in failed(decision)] == ["sanity.tokens"]


def test_unusable_champion_record_does_not_block_and_says_so():
    decision = registry.decide(report(3.0), report(float("nan")), GATE)
    assert decision.action == "promote"
    assert decision.champion_bits_per_byte is None
    assert any("champion record unusable" in r for r in decision.reasons)


def test_decide_is_pure_and_json_safe():
    cand, champ = report(3.1), report(3.0)
    first, second = registry.decide(cand, champ, GATE), registry.decide(cand, champ, GATE)
    assert first == second
    assert Decision.from_json(first.to_json()) == first
    assert cand == report(3.1) and champ == report(3.0)


# --------------------------------------------------------------------- refusals before any request


@pytest.fixture
def no_mlflow_requests(monkeypatch):
    def explode():
        raise AssertionError("an MLflow client was created: a request would have been sent")

    monkeypatch.setattr(registry.mlflow_io, "_client", explode)


def test_sandbox_rollback_of_production_model_refused_before_any_request(no_mlflow_requests):
    with pytest.raises(PolicyError, match=f"may not write registered model '{PRODUCTION_MODEL}'"):
        registry.rollback(PRODUCTION_MODEL, SANDBOX, "mallory", reason="forged")


def test_sandbox_policy_cannot_even_be_built_with_the_production_model():
    with pytest.raises(PolicyError):
        dataclasses.replace(SANDBOX, target_model=PRODUCTION_MODEL,
                            writable_models=(*SANDBOX.writable_models, PRODUCTION_MODEL))


def test_hold_decision_is_never_promoted(no_mlflow_requests):
    hold = registry.decide(report(9.0), None, GATE)
    with pytest.raises(PolicyError, match="held"):
        registry.promote(policy=PRODUCTION, candidate_version="1", decision=hold, run_key="d/r")
    with pytest.raises(PolicyError, match="held"):
        registry.promote(policy=PRODUCTION, candidate_version="1", decision=hold, run_key="d/r", manual_approver="alice")


def test_a_manual_promotion_needs_a_named_approver(no_mlflow_requests):
    ok = registry.decide(report(3.0), None, GATE)
    with pytest.raises(PolicyError, match="named approver"):
        registry.promote(policy=PRODUCTION, candidate_version="1", decision=ok, run_key="d/r", manual_approver=" ")


def test_cli_sandbox_promote_of_production_model_refused_before_any_request(no_mlflow_requests):
    from kiln.cli import registry as cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["promote", PRODUCTION_MODEL, "1", "--policy", "sandbox", "--approver", "mallory"])
    assert args.func is cli.handler
    with pytest.raises(PolicyError, match="sandbox"):
        args.func(args)


def test_run_key_must_name_dag_and_run():
    assert split_run_key("kiln_production/manual__2026-11-29T16:00:00+00:00") == (
        "kiln_production", "manual__2026-11-29T16:00:00+00:00",
    )
    with pytest.raises(ConfigError):
        split_run_key("no-slash")


def test_filter_values_with_quotes_are_refused():
    with pytest.raises(ConfigError):
        registry.mlflow_io._quote("a'b", "run_key")


def test_importing_registry_stays_cheap():
    # DAG files import kiln: a fresh interpreter importing these modules must not load mlflow/torch/airflow.
    code = (
        "import sys, kiln.registry, kiln.stack.mlflow_server, kiln.cli.registry;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlflow', 'torch', 'airflow'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_record_review_refuses_an_unknown_outcome_before_any_request(no_mlflow_requests):
    with pytest.raises(ConfigError, match="outcome"):
        registry.record_review(policy=PRODUCTION, candidate_version="1", run_key="d/r", outcome="approved-ish",
                               reviewer="a", at="")


@pytest.mark.parametrize("record", ["promotion", "rollback"])
def test_an_approval_by_someone_who_is_not_a_reviewer_is_never_recorded(no_mlflow_requests, record):
    """The HITL endpoint answers only assigned users, but an auth manager may be configured to let
    anyone answer (SimpleAuthManager's ``simple_auth_manager_all_admins``): kiln checks again."""
    at = "2026-12-01T12:00:00+00:00"
    calls = {
        "promotion": lambda who, when: registry.record_review(
            policy=PRODUCTION, candidate_version="1", run_key="kiln_production/r", outcome="approved", reviewer=who,
            at=when),
        "rollback": lambda who, when: registry.record_rollback_review(
            policy=PRODUCTION, from_version="3", to_version="2", run_key="kiln_champion_watch/r", outcome="approved",
            reviewer=who, at=when),
    }
    assert "sandbox-user" not in PRODUCTION.reviewers
    with pytest.raises(PolicyError, match="'sandbox-user' answered Approve, but is not one of policy 'production'"):
        calls[record]("sandbox-user", at)
    with pytest.raises(ConfigError, match="time it was given"):
        calls[record]("reviewer", "")
    with pytest.raises(ConfigError, match="run_key"):
        registry.record_review(policy=PRODUCTION, candidate_version="1", run_key="no-run", outcome="rejected",
                               reviewer="reviewer", at=at)


def test_review_subjects_name_exactly_what_was_asked():
    assert registry.promotion_subject("m.candidates", "7") == "promote m.candidates version 7"
    assert registry.promotion_subject("m.candidates", "7") != registry.promotion_subject("m.candidates", "17")
    assert registry.rollback_subject("m", "champion", "3", "2") == "roll m@champion back from version 3 to version 2"
    assert registry.REVIEW_TAGS["promotion"]["outcome"] == "kiln.review"
    # A promoted copy carries its candidate's review tags: a rollback review never shares their keys.
    assert not set(registry.REVIEW_TAGS["promotion"].values()) & set(registry.REVIEW_TAGS["rollback"].values())


# ------------------------------------------------------------------------------ retry with backoff


def test_retry_policy_from_env_defaults_and_capped_exponential_delays(monkeypatch):
    for name in ("KILN_REGISTRY_RETRIES", "KILN_REGISTRY_BACKOFF_S", "KILN_REGISTRY_BACKOFF_MAX_S"):
        monkeypatch.delenv(name, raising=False)
    assert registry.RetryPolicy.from_env().delays() == [2.0, 4.0, 8.0]
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "5")
    monkeypatch.setenv("KILN_REGISTRY_BACKOFF_S", "1.5")
    monkeypatch.setenv("KILN_REGISTRY_BACKOFF_MAX_S", "5")
    assert registry.RetryPolicy.from_env().delays() == [1.5, 3.0, 5.0, 5.0, 5.0]
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "0")
    assert registry.RetryPolicy.from_env().delays() == []


@pytest.mark.parametrize(
    ("name", "value"),
    [("KILN_REGISTRY_RETRIES", "three"), ("KILN_REGISTRY_RETRIES", "-1"), ("KILN_REGISTRY_BACKOFF_S", "nan"),
     ("KILN_REGISTRY_BACKOFF_MAX_S", "0.1")],
)
def test_bad_retry_settings_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        registry.RetryPolicy.from_env()


def _mlflow_errors():
    import requests
    from mlflow.exceptions import MlflowException, RestException

    down = MlflowException("API request to http://127.0.0.1:1/api/2.0/mlflow/model-versions/get failed with "
                           "exception HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded")
    bad_gateway = MlflowException("API request to endpoint /api/2.0/mlflow/x failed with error code 502 != 200. "
                                  "Response body: 'Bad Gateway'")
    transient = {
        "connection refused": down,
        "HTTP 502": bad_gateway,
        "server error": RestException({"error_code": "INTERNAL_ERROR", "message": "database is locked"}),
        "unavailable": RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "later"}),
        "requests": requests.exceptions.ConnectionError("reset"),
        "socket": ConnectionRefusedError(111, "refused"),
    }
    permanent = {
        "not found": RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such version"}),
        "bad value": RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad"}),
        "client-side": MlflowException("Run with UUID abc is already active."),
        "programming": ValueError("bug"),
    }
    return transient, permanent


def test_transient_failures_are_told_apart_from_refusals():
    transient, permanent = _mlflow_errors()
    assert {k for k, e in transient.items() if not registry.is_transient(e)} == set()
    assert {k for k, e in permanent.items() if registry.is_transient(e)} == set()


def _flaky(failures: list[BaseException], result: str = "done"):
    calls = []

    def body() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return result

    return body, calls


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    recorded: list[float] = []
    monkeypatch.setattr(registry.mlflow_io, "_sleep", recorded.append)
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "3")
    monkeypatch.setenv("KILN_REGISTRY_BACKOFF_S", "1")
    monkeypatch.delenv("KILN_REGISTRY_BACKOFF_MAX_S", raising=False)
    return recorded


def test_transient_failures_are_retried_with_backoff_until_success(sleeps):
    transient, _ = _mlflow_errors()
    body, calls = _flaky([transient["connection refused"], transient["server error"]])
    assert registry.mlflow_io._with_retries("promoting x", body) == "done"
    assert len(calls) == 3 and sleeps == [1.0, 2.0]


def test_retries_are_bounded_then_a_retryable_registry_error(sleeps):
    transient, _ = _mlflow_errors()
    body, calls = _flaky([transient["connection refused"]] * 10)
    with pytest.raises(RegistryError, match=r"after 4 attempt\(s\)") as err:
        registry.mlflow_io._with_retries("promoting x", body)
    assert err.value.retryable and err.value.__cause__ is transient["connection refused"]
    assert len(calls) == 4 and sleeps == [1.0, 2.0, 4.0]


def test_refusals_and_kiln_errors_are_not_retried(sleeps):
    _, permanent = _mlflow_errors()
    body, calls = _flaky([permanent["not found"]])
    with pytest.raises(RegistryError, match="no such version"):
        registry.mlflow_io._with_retries("reading x", body)
    body, policy_calls = _flaky([PolicyError("no")])
    with pytest.raises(PolicyError):
        registry.mlflow_io._with_retries("promoting x", body)
    body, bug_calls = _flaky([ValueError("bug")])
    with pytest.raises(ValueError):
        registry.mlflow_io._with_retries("promoting x", body)
    assert (len(calls), len(policy_calls), len(bug_calls)) == (1, 1, 1) and sleeps == []


# ------------------------------------------------------------------------------- evaluation report


def test_loss_history_from_metrics_jsonl_keeps_the_last_value_per_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 4.0}\n{"step": 2, "loss": 3.0}\n'
        '{"step": 2, "event": "rollback", "kind": "rollback", "at_step": 2, "loss": 99.0}\n'
        '{"step": 2, "loss": 3.5}\n{"step": 3, "loss": null}\n{"step": 4, "lr": 0.1}\n'
        'not json\n{"step": 5, "loss": 2.0}\n{"step": 6, "lo'
    )
    assert registry.read_loss_jsonl(path) == [(1, 4.0), (2, 3.5), (5, 2.0)]
    assert registry.read_loss_jsonl(tmp_path / "missing.jsonl") == []


def test_loss_curve_svg_is_well_formed_and_draws_every_point():
    import xml.etree.ElementTree as ET

    curve = registry.LossCurve(points=[(1, 4.0), (2, 3.0), (10, 2.5)], source="test", rollbacks=[2])
    svg = ET.fromstring(registry.loss_curve_svg(curve, {"candidate <eval> loss": 2.7}))
    ns = "{http://www.w3.org/2000/svg}"
    (polyline,) = svg.iter(f"{ns}polyline")
    assert len(polyline.get("points").split()) == 3
    assert any("candidate <eval> loss" in (t.text or "") for t in svg.iter(f"{ns}text"))
    assert len(list(svg.iter(f"{ns}line"))) == 2  # the reference line and the rollback marker
    empty = ET.fromstring(registry.loss_curve_svg(registry.LossCurve(points=[], source="none", rollbacks=[]), {}))
    assert "no training loss" in "".join(empty.itertext())


def test_loss_curve_png_when_matplotlib_is_installed():
    pytest.importorskip("matplotlib")
    curve = registry.LossCurve(points=[(1, 4.0), (2, 3.0)], source="test", rollbacks=[])
    assert registry.loss_curve_png(curve, {"candidate eval loss": 2.9})[:8] == b"\x89PNG\r\n\x1a\n"
    assert registry.loss_curve_png(registry.LossCurve(points=[], source="none", rollbacks=[]), {}) is None


def test_report_compares_candidate_and_champion_and_escapes_html():
    tags = {RUN_KEY_TAG: "kiln_production/<run>", registry.TAGS["dvc"]: "outs: []",
            registry.TAGS["decision_champion_version"]: "4", "kiln.note": "<script>"}
    decision = registry.decide(report(2.9), report(3.0), GATE)
    curve = registry.LossCurve(points=[], source="none (no loss was logged)", rollbacks=[])
    page = registry.report_html(report(2.9), report(3.0), decision, tags, curve, None, None)
    assert "<td>2.9000</td><td>3.0000</td><td>-0.1000</td>" in page and "champion (v4)" in page
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;run&gt;" in page
    markdown = registry.report_markdown(report(2.9), None, registry.decide(report(2.9), None, GATE), tags, curve, None)
    assert "| bits per byte | 2.9000 | — | — |" in markdown and "No loss curve" in markdown


def test_rollback_needs_a_reason_before_any_request(no_mlflow_requests):
    with pytest.raises(PolicyError, match="reason"):
        registry.rollback(PRODUCTION_MODEL, PRODUCTION, "alice", reason="  ")


# ------------------------------------------------------------------- MLflow refusals are not retried


def test_server_refusals_become_non_retryable_kiln_errors(monkeypatch):
    from mlflow.exceptions import MlflowException

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "kiln-sandbox")
    forbidden = registry.mlflow_io._refusal(MlflowException(
        "API request to endpoint /api/2.0/mlflow/model-versions/create failed with error code 403 != 200. "
        "Response body: 'Permission denied'"))
    assert isinstance(forbidden, PolicyError) and "'kiln-sandbox'" in str(forbidden) and not forbidden.retryable
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED

    assert isinstance(registry.mlflow_io._refusal(MlflowException("x", error_code=PERMISSION_DENIED)), PolicyError)
    unauthenticated = registry.mlflow_io._refusal(MlflowException("request failed with error code 401 != 200"))
    assert isinstance(unauthenticated, ConfigError) and not unauthenticated.retryable
    assert registry.mlflow_io._refusal(MlflowException("failed with error code 503 != 200")) is None
    assert registry.mlflow_io._refusal(ValueError("403")) is None


# ----------------------------------------------------------------------------------------- audit


def test_audit_tag_key_is_deterministic_and_value_is_json():
    import json

    at = "2026-11-29T19:41:02.123456+00:00"
    tag = registry.audit_tag("rollback", at, actor="alice", reason="x" * 5000, from_version="3", to_version="2")
    ((key, value),) = tag.items()
    assert key == "kiln.audit.20261129T194102Z.rollback"
    assert tag == registry.audit_tag("rollback", at, actor="alice", reason="x" * 5000, from_version="3", to_version="2")
    body = json.loads(value)
    assert body["event"] == "rollback" and body["actor"] == "alice" and len(body["reason"]) == registry.AUDIT_TEXT_MAX
    with pytest.raises(ConfigError):
        registry.audit_tag("deleted", at)
    with pytest.raises(ConfigError):
        registry.audit_tag("rollback", "yesterday")


def test_audit_table_says_who_when_what():
    from kiln.cli.audit import format_table

    table = format_table([
        {"event": "review", "at": "2026-01-01T10:00:00+00:00", "model": "m.candidates", "version": "4",
         "actor": "reviewer", "decision": "rejected", "comment": "loss curve spikes"},
        {"event": "promotion", "at": "2026-01-02T10:00:00+00:00", "model": "m", "version": "2", "actor": "bob",
         "from_version": "1", "to_version": "2", "run_key": "kiln_production/r2"},
        {"event": "rollback", "at": "2026-01-03T10:00:00+00:00", "model": "m", "version": "1", "actor": "carol",
         "from_version": "2", "to_version": "1", "reason": "INC-7"},
    ])
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["WHEN", "(UTC)", "EVENT", "MODEL/VERSION"]
    assert "review: rejected — loss curve spikes" in lines[1] and "reviewer" in lines[1]
    assert "champion 1 -> 2" in lines[2] and "bob" in lines[2]
    assert "champion 2 -> 1: INC-7" in lines[3] and "carol" in lines[3]
    assert format_table([]) == "no reviews, promotions or rollbacks recorded"


# ------------------------------------------------------------------------------ per-policy identity


def test_identity_from_env_needs_both_halves_and_hides_the_password():
    from kiln.mlflow_auth import MlflowIdentity, identity_env_names, identity_from_env

    user_var, password_var = identity_env_names(PRODUCTION)
    assert (user_var, password_var) == ("KILN_MLFLOW_PRODUCTION_USERNAME", "KILN_MLFLOW_PRODUCTION_PASSWORD")
    assert identity_from_env(PRODUCTION, {}) is None
    found = identity_from_env(PRODUCTION, {user_var: "kiln-production", password_var: "s3cret-s3cret"})
    assert found == MlflowIdentity("kiln-production", "s3cret-s3cret", source="environment")
    assert "s3cret" not in repr(found)
    with pytest.raises(ConfigError, match=password_var):
        identity_from_env(PRODUCTION, {user_var: "kiln-production"})
    # the sandbox's variables are its own: production's do not make a sandbox identity
    assert identity_from_env(SANDBOX, {user_var: "kiln-production", password_var: "s3cret-s3cret"}) is None


def test_use_identity_sets_aside_the_workers_identity_and_restores_it(monkeypatch):
    import os

    from kiln.mlflow_auth import MlflowIdentity, use_identity

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "kiln-production")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "production-password")
    with use_identity(MlflowIdentity("kiln-sandbox", "sandbox-password")):
        assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == (
            "kiln-sandbox", "sandbox-password")
    with use_identity(None):  # anonymous: never the worker's (production) identity
        assert "MLFLOW_TRACKING_USERNAME" not in os.environ and "MLFLOW_TRACKING_PASSWORD" not in os.environ
    with pytest.raises(RuntimeError), use_identity(MlflowIdentity("kiln-sandbox", "sandbox-password")):
        raise RuntimeError("a failing stage still gives the environment back")
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "kiln-production"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "production-password"


def test_dag_tasks_take_their_policys_identity_from_the_stacks_connections(tmp_path, monkeypatch):
    """The stack's generated connections (as the scheduler's environment carries them) are what
    the DAG adapter resolves per policy; no connection → the KILN_MLFLOW_<POLICY>_* variables."""
    from kiln.airflow import dagfactory
    from kiln.stack import embedded as kiln_stack

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    conns = kiln_stack.mlflow_connections()
    assert set(conns) == {"AIRFLOW_CONN_KILN_MLFLOW_PRODUCTION", "AIRFLOW_CONN_KILN_MLFLOW_SANDBOX"}
    passwords = kiln_stack.mlflow_passwords()
    assert (tmp_path / "mlflow" / "auth" / "identities.json").stat().st_mode & 0o077 == 0
    for key, value in conns.items():
        monkeypatch.setenv(key, value)
    production, sandbox = dagfactory._mlflow_identity(PRODUCTION), dagfactory._mlflow_identity(SANDBOX)
    assert (production.username, production.source) == ("kiln-production", "connection kiln_mlflow_production")
    assert production.password == passwords["kiln-production"]
    assert (sandbox.username, sandbox.password) == ("kiln-sandbox", passwords["kiln-sandbox"])
    assert production.password != sandbox.password

    monkeypatch.delenv("AIRFLOW_CONN_KILN_MLFLOW_SANDBOX")
    monkeypatch.setenv("KILN_MLFLOW_SANDBOX_USERNAME", "someone")
    monkeypatch.setenv("KILN_MLFLOW_SANDBOX_PASSWORD", "from-a-secret-store")
    assert dagfactory._mlflow_identity(SANDBOX).source == "environment"


def test_an_unreadable_s3_artifact_store_is_a_registry_error_naming_the_action():
    """A version whose source is in an S3 store this process cannot read (no credentials, no
    endpoint) fails as ``RegistryError`` naming what was being done, not a raw botocore trace."""
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    for exc in (NoCredentialsError(), EndpointConnectionError(endpoint_url="https://bucket.s3.amazonaws.com/")):
        with (pytest.raises(RegistryError, match="downloading models:/m/1: .*(credentials|endpoint)"),
              registry.mlflow_io._translated("downloading models:/m/1")):
            raise exc


def test_a_training_a_mixture_cap_ended_says_so_in_a_tag_and_on_the_version_page():
    """The trainer's ``result.json`` ``stop`` (a mixture's capped source) reaches ``TrainResult`` and
    the version's ``kiln.train.stop``; a training that ran its recipe's steps has no such tag."""
    from kiln.refs import TrainResult
    from kiln.registry.register import train_stop_tags

    base = {"run_dir": "/r", "checkpoint": "/r/c", "checkpoint_manifest_sha256": "a" * 64, "weights_sha256": "b" * 64,
            "step": 4, "metrics": {}, "total_steps": 8, "completed": True}
    stop = {"reason": "mixture_cap", "source": "prose", "limit": "max_epochs = 1", "draws": 48, "loader_step": 4,
            "step": 4}
    capped = TrainResult.from_json({**base, "stop": stop})
    assert capped.stop == stop and TrainResult.from_json(capped.to_json()) == capped
    assert train_stop_tags(capped) == {"kiln.train.stop": "mixture_cap: source 'prose' reached max_epochs = 1 after 48 "
                                                           "draws; stopped at step 4 of 8"}
    full = TrainResult.from_json({**base, "step": 8})
    assert full.stop is None and "stop" not in full.to_json() and train_stop_tags(full) == {}

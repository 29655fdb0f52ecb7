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
from kiln.errors import ConfigError, PolicyError
from kiln.policy import PRODUCTION, PRODUCTION_MODEL, SANDBOX, GatePolicy
from kiln.refs import Decision, EvalReport

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
    ]  # fmt: skip
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

    monkeypatch.setattr(registry, "_client", explode)


def test_sandbox_rollback_of_production_model_refused_before_any_request(no_mlflow_requests):
    with pytest.raises(PolicyError, match=f"may not write registered model '{PRODUCTION_MODEL}'"):
        registry.rollback(PRODUCTION_MODEL, SANDBOX, "mallory")


def test_sandbox_policy_cannot_even_be_built_with_the_production_model():
    with pytest.raises(PolicyError):
        dataclasses.replace(SANDBOX, target_model=PRODUCTION_MODEL,
                            writable_models=(*SANDBOX.writable_models, PRODUCTION_MODEL))  # fmt: skip


def test_hold_decision_is_never_promoted(no_mlflow_requests):
    hold = registry.decide(report(9.0), None, GATE)
    with pytest.raises(PolicyError, match="held"):
        registry.promote(policy=PRODUCTION, candidate_version="1", decision=hold, approver="alice", run_key="d/r")


def test_promotion_needs_an_approver(no_mlflow_requests):
    ok = registry.decide(report(3.0), None, GATE)
    with pytest.raises(PolicyError, match="approver"):
        registry.promote(policy=PRODUCTION, candidate_version="1", decision=ok, approver=" ", run_key="d/r")


def test_cli_sandbox_promote_of_production_model_refused_before_any_request(no_mlflow_requests):
    from kiln.cli import registry as cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["promote", PRODUCTION_MODEL, "1", "--policy", "sandbox", "--approver", "mallory"])
    assert args.func is cli.handler
    with pytest.raises(PolicyError, match="sandbox"):
        args.func(args)


def test_run_key_must_name_dag_and_run():
    assert registry.split_run_key("kiln_production/manual__2026-11-29T16:00:00+00:00") == (
        "kiln_production", "manual__2026-11-29T16:00:00+00:00",
    )  # fmt: skip
    with pytest.raises(ConfigError):
        registry.split_run_key("no-slash")


def test_filter_values_with_quotes_are_refused():
    with pytest.raises(ConfigError):
        registry._quote("a'b", "run_key")


def test_importing_registry_stays_cheap():
    # DAG files import kiln: a fresh interpreter importing these modules must not load mlflow/torch/airflow.
    code = (
        "import sys, kiln.registry, kiln.mlflow_server, kiln.cli.registry;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlflow', 'torch', 'airflow'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

from __future__ import annotations

import pytest

from kiln.errors import PolicyError
from kiln.policy import PRODUCTION, PRODUCTION_MODEL, SANDBOX, GatePolicy, Policy, get_policy


def test_sandbox_can_never_write_a_production_name():
    with pytest.raises(PolicyError, match=PRODUCTION_MODEL):
        SANDBOX.check_model_write(PRODUCTION_MODEL)
    with pytest.raises(PolicyError):
        SANDBOX.check_model_write(PRODUCTION.candidate_model)
    SANDBOX.check_model_write(SANDBOX.candidate_model)


def test_a_sandbox_policy_that_lists_the_production_model_is_refused():
    with pytest.raises(PolicyError, match="sandbox policy may never write"):
        Policy(**{**{f: getattr(SANDBOX, f) for f in SANDBOX.__dataclass_fields__},
                  "writable_models": (SANDBOX.candidate_model, PRODUCTION_MODEL)})


def test_production_accepts_only_pinned_recipes():
    assert PRODUCTION.resolve_recipe(None).name == "small.toml"
    with pytest.raises(PolicyError, match="allows only recipes under"):
        PRODUCTION.resolve_recipe("tiny.toml")
    with pytest.raises(PolicyError, match="allows only recipes under"):
        SANDBOX.resolve_recipe("../../pyproject.toml")
    with pytest.raises(PolicyError, match="does not exist"):
        SANDBOX.resolve_recipe("nope.toml")


def test_gate_policy_names_the_bad_field():
    with pytest.raises(PolicyError, match="max_bits_per_byte"):
        GatePolicy(max_bits_per_byte=0, max_regression=0.1)
    with pytest.raises(PolicyError, match="max_regression"):
        GatePolicy(max_bits_per_byte=1, max_regression=-1)


def test_policies_differ_where_they_must():
    assert PRODUCTION.requires_approval and not SANDBOX.requires_approval
    assert PRODUCTION.priority_weight > SANDBOX.priority_weight
    assert PRODUCTION.pool != SANDBOX.pool
    assert PRODUCTION.max_quarantine_share < SANDBOX.max_quarantine_share
    assert PRODUCTION.pinned_inputs and not SANDBOX.pinned_inputs
    assert PRODUCTION.max_active_runs == 1
    assert SANDBOX.schedule_cron is None and not SANDBOX.schedule_on_corpus_asset
    assert get_policy("sandbox") is SANDBOX
    with pytest.raises(PolicyError, match="unknown policy"):
        get_policy("staging")


def test_doc_lists_the_coded_settings_and_where_each_run_time_override_is_read():
    from kiln.policy import SANDBOX

    assert "read at run time" not in SANDBOX.doc_md()
    doc = SANDBOX.doc_md([("kiln_sandbox_launcher", "where training runs", "`train`: log line `launcher in force: …`")])
    assert "| `launcher` | `local` |" in doc and "(as coded)" in doc
    assert ("| `kiln_sandbox_launcher` (or `AIRFLOW_VAR_KILN_SANDBOX_LAUNCHER`) | where training runs | "
            "`train`: log line `launcher in force: …` |") in doc
    assert "never when this file is parsed" in doc and "without retry" in doc

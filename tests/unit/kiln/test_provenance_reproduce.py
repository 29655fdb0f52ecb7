"""kiln reproduce's pure parts: what a statement lacks is named, the recorded recipe written back as a
file resolves to the same recipe, paths are moved only where they occur, the installed code against the
recorded one, and the attestation verifies only with the reproducer's key.

The whole reproduction, against a real MLflow server and DVC remote: tests/integration/test_reproduce.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from provenance_fixtures import H, inputs, make_artifact

from kiln.errors import ProvenanceError
from kiln.provenance.attestation import attestation_statement, verify_attestation
from kiln.provenance.keys import signing_key
from kiln.provenance.reproduce import (
    Comparison,
    Reproduction,
    code_drift,
    missing_records,
    plan_from_statement,
    recipe_toml,
    relocated,
)
from kiln.provenance.sign import dsse_envelope
from kiln.provenance.statement import build_statement, code_sha256, statement_bytes
from kiln.shipped import RECIPES_DIR
from kiln_trainer.config import load_recipe
from kiln_trainer.contract import canonical_json

RECIPE = load_recipe(RECIPES_DIR / "tiny.toml").to_dict()


def _statement(tmp_path: Path, **changes):
    fields = {"recipe": RECIPE, "seed": RECIPE["train"]["seed"], "strategy": "ddp", "snapshot_path": "/kiln/snapshots/x",
              "max_quarantine_share": 0.5, "eval_report": {"bits_per_byte": 2.5, "weights_sha256": "e" * 64}}
    return build_statement(make_artifact(tmp_path / "a"), inputs(**{**fields, **changes}))


def test_a_statement_with_every_record_plans_a_reproduction(tmp_path):
    plan = plan_from_statement(_statement(tmp_path))
    assert (plan.snapshot_path, plan.max_quarantine_share, plan.tokenizer_sha256, plan.weights_sha256) == (
        "/kiln/snapshots/x", 0.5, H, "e" * 64)
    assert (plan.seed, plan.world_size, plan.strategy, plan.steps, plan.contract) == (1337, 2, "ddp", 12, "stdlib-py@1")
    assert plan.token_manifest_uri == "/runs/r/tokens/token_manifest.json" and plan.recipe_sha256 == ""


@pytest.mark.parametrize(("change", "named"), [
    ({"snapshot_path": ""}, "the snapshot path the run read"),
    ({"max_quarantine_share": None}, "max_quarantine_share"),
    ({"contract_suite_sha256": ""}, "the contract suite's sha256"),
    ({"quarantine_report_sha256": ""}, "the quarantine report's sha256"),
    ({"tokenizer_sha256": ""}, "the tokenizer's sha256"),
    ({"token_manifest_sha256": "", "token_manifest_uri": ""}, "the token manifest (a run of the byte stream"),
    ({"token_manifest_uri": ""}, "the token manifest's location"),
    ({"eval_report": {"bits_per_byte": 2.5}}, "the weights' sha256"),
])
def test_what_the_statement_lacks_is_named_and_refused(tmp_path, change, named):
    statement = _statement(tmp_path, **change)
    assert any(named in line for line in missing_records(statement)), missing_records(statement)
    with pytest.raises(ProvenanceError, match="does not record what reproducing needs: .*" + named.split(" (")[0]):
        plan_from_statement(statement)


def test_a_statement_whose_seed_is_not_its_recipes_is_refused(tmp_path):
    with pytest.raises(ProvenanceError, match="seed 7 is not its recipe's 1337"):
        plan_from_statement(_statement(tmp_path, seed=7))


@pytest.mark.parametrize("recipe", ["tiny.toml", "tiny-bpe.toml", "small.toml"])
def test_the_recorded_recipe_written_back_resolves_to_the_same_recipe(tmp_path, recipe):
    resolved = load_recipe(RECIPES_DIR / recipe)
    path = tmp_path / "recipe.toml"
    path.write_text(recipe_toml(resolved.to_dict()))
    assert load_recipe(path).sha256 == resolved.sha256


def test_a_string_toml_must_escape_comes_back_the_same(tmp_path):
    bpe = load_recipe(RECIPES_DIR / "tiny-bpe.toml").to_dict()
    odd = {**bpe, "tokenizer": {**bpe["tokenizer"], "eos_token": 'say "é"\t\x7f\\'}}
    path = tmp_path / "recipe.toml"
    path.write_text(recipe_toml(odd))
    assert load_recipe(path).to_dict()["tokenizer"]["eos_token"] == 'say "é"\t\x7f\\'


def test_a_recipe_value_toml_cannot_hold_is_refused():
    with pytest.raises(ProvenanceError, match=r"train\.steps is a tuple"):
        recipe_toml({"train": {"steps": (1, 2)}})


def test_relocation_moves_paths_in_every_string_and_key_only():
    doc = {"path": "/w/snapshot/train/a.parquet", "n": 3, "reasons": ["dup of /w/snapshot/train/b.parquet"],
           "/w/snapshot/k": [1.5, True, None], "other": "/w/snapshots"}
    moved = relocated(doc, {"/w/snapshot/": "/kiln/snapshots/x/"})
    assert moved == {"path": "/kiln/snapshots/x/train/a.parquet", "n": 3,
                     "reasons": ["dup of /kiln/snapshots/x/train/b.parquet"], "/kiln/snapshots/x/k": [1.5, True, None],
                     "other": "/w/snapshots"}


def test_code_drift_compares_the_installed_code_with_the_recorded(tmp_path):
    plan = plan_from_statement(_statement(tmp_path, code_sha256=code_sha256()))
    assert code_drift(plan) == []
    drifted = dataclasses.replace(plan, code_sha256="0" * 64)
    assert code_drift(drifted) == [f"kiln and kiln_trainer: recorded code sha256 {'0' * 64}, installed {code_sha256()}"]
    user = dataclasses.replace(plan, trainer_spec="no_such_pkg.train:main", trainer_sha256="1" * 64)
    assert code_drift(user) == [f"trainer package no_such_pkg: recorded sha256 {'1' * 64}, installed not installed"]


def test_the_attestation_verifies_with_the_reproducers_key_only(tmp_path):
    outcome = Reproduction(model="m", version="3", policy="production", verdict="differs",
                           reason="validate: quarantine report differs",
                           comparisons=(Comparison("snapshot", "snapshot x", "a", "a"),
                                        Comparison("validate", "quarantine report", "b", "c")))
    statement = attestation_statement(outcome, "d" * 64)
    assert statement["subject"] == [{"name": "models:/m/3/provenance.dsse.json", "digest": {"sha256": "d" * 64}}]
    assert statement["predicate"]["verdict"] == "differs" and statement["predicate"]["comparisons"][1]["same"] is False
    path = tmp_path / "reproduction.dsse.json"
    path.write_bytes(canonical_json(dsse_envelope(statement_bytes(statement), signing_key("sandbox", tmp_path))))
    assert verify_attestation(path, home=tmp_path) == statement
    path.write_bytes(canonical_json(dsse_envelope(statement_bytes(statement), signing_key("production", tmp_path))))
    with pytest.raises(ProvenanceError, match="a key of policy production"):
        verify_attestation(path, home=tmp_path)
    envelope = json.loads(path.read_bytes())
    envelope["payload"] = envelope["payload"][:-4] + "AAAA"
    path.write_text(json.dumps(envelope))
    with pytest.raises(ProvenanceError):
        verify_attestation(path, home=tmp_path)


def test_the_outcome_in_words_names_the_step_and_both_digests():
    outcome = Reproduction(model="m", version="3", policy="sandbox", verdict="differs",
                           reason=str(Comparison("train", "weights", "a" * 64, "b" * 64)),
                           comparisons=(Comparison("train", "weights", "a" * 64, "b" * 64),), code_drift=("kiln: x",))
    text = "\n".join(outcome.in_words())
    assert f"does not reproduce: train: weights differs: recorded {'a' * 64}, re-derived {'b' * 64}" in text
    assert "code drift: kiln: x" in text

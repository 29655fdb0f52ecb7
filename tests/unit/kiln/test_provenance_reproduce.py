"""kiln reproduce's pure parts: what a statement lacks is named, the recorded recipe written back as a
file resolves to the same recipe, paths are moved only where they occur, the installed code against the
recorded one, and the attestation verifies only with the reproducer's key. At another world size: the
world sizes the recorded global batch splits to, the weights compared through the export's mapping
(a perturbed weight caught, named with both values), the data order against the one seed and step give,
and the verdict in words, tags and attestation.

The whole reproduction, against a real MLflow server and DVC remote: tests/integration/test_reproduce.py."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
from provenance_fixtures import H, inputs, make_artifact

from kiln.cli import main as kiln_main
from kiln.errors import ConfigError, ProvenanceError
from kiln.provenance.attestation import attestation_statement, verdict_size_tags, verify_attestation
from kiln.provenance.keys import signing_key
from kiln.provenance.reproduce import (
    DEFAULT_TOLERANCE,
    EVAL_COMPARED,
    EVAL_NOT_COMPARED,
    Comparison,
    Reproduction,
    WeightsDifference,
    check_world_size,
    code_drift,
    compare_eval_report,
    compare_folder,
    compare_weights,
    data_order,
    load_folder_weights,
    missing_records,
    plan_from_statement,
    recipe_toml,
    relocated,
    reproduce,
)
from kiln.provenance.sign import dsse_envelope
from kiln.provenance.statement import artifact_files, build_statement, code_sha256, statement_bytes
from kiln.refs import sha256_file
from kiln.shipped import RECIPES_DIR
from kiln_trainer.config import load_recipe
from kiln_trainer.contract import canonical_json

RECIPE = load_recipe(RECIPES_DIR / "tiny.toml").to_dict()


EVAL_REPORT = {"checkpoint": "/kiln/runs/r/checkpoints/step-00000012", "weights_sha256": "e" * 64, "split": "eval",
               "bits_per_byte": 2.4805891062331396, "loss": 1.719386672973633, "tokens": 8192, "step": 12,
               "windows": 64, "snapshot_id": "0123456789abcdef0123456789abcdef.dir", "training_manifest_sha256": H,
               "checkpoint_manifest_sha256": "c" * 64}
"""An evaluation report as the register stage signs it (``EvalReport.to_json``)."""


def _statement(tmp_path: Path, **changes):
    fields = {"recipe": RECIPE, "seed": RECIPE["train"]["seed"], "strategy": "ddp", "snapshot_path": "/kiln/snapshots/x",
              "max_quarantine_share": 0.5, "eval_report": EVAL_REPORT}
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
    ({"eval_report": {k: v for k, v in EVAL_REPORT.items() if k not in ("loss", "windows")}},
     "the evaluation report's windows, loss"),
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


# ---------------------------------------------------- after training: the evaluation, the Hugging Face folder


def _signed_plan(tmp_path: Path, **changes):
    """The plan of a statement as a verifier reads it: through its signed bytes (canonical JSON) and back."""
    return plan_from_statement(json.loads(statement_bytes(_statement(tmp_path, **changes))))


def test_the_plan_carries_the_signed_evaluation_report_and_the_folder_s_files(tmp_path):
    plan = _signed_plan(tmp_path)
    assert plan.eval_report == EVAL_REPORT  # every float the same bits after the signed JSON
    assert plan.hf_files == {"config.json": sha256_file(tmp_path / "a" / "artifacts/hf_model/config.json"),
                             "model.safetensors": sha256_file(tmp_path / "a" / "artifacts/hf_model/model.safetensors")}


def test_a_statement_without_the_folder_s_files_is_refused_naming_them(tmp_path):
    bare = tmp_path / "bare"
    (bare / "artifacts").mkdir(parents=True)
    (bare / "MLmodel").write_text("flavors: {}\n")
    statement = build_statement(bare, inputs(recipe=RECIPE, seed=RECIPE["train"]["seed"], snapshot_path="/s",
                                             max_quarantine_share=0.5, eval_report=EVAL_REPORT))
    assert missing_records(statement) == ["the Hugging Face folder's files (subjects under artifacts/hf_model/)"]


def test_the_same_evaluation_report_compares_field_by_field_and_leaves_out_the_paths(tmp_path):
    plan = _signed_plan(tmp_path)
    derived = {**EVAL_REPORT, "checkpoint": "/work/derived/train/checkpoints/step-00000012",
               "checkpoint_manifest_sha256": "d" * 64, "training_manifest_sha256": "9" * 64, "bytes": 8133,
               "kind": "kiln.EvalReport"}
    compared = compare_eval_report(plan.eval_report, derived, training_manifest=("9" * 64, H))
    assert [c.input for c in compared] == [f"evaluation report {name}" for name in EVAL_COMPARED]
    assert all(c.same and c.step == "evaluate" for c in compared), [str(c) for c in compared if not c.same]
    assert set(EVAL_COMPARED).isdisjoint(EVAL_NOT_COMPARED) and set(EVAL_COMPARED) | set(EVAL_NOT_COMPARED) == set(
        EVAL_REPORT)
    bits = next(c for c in compared if c.input.endswith("bits_per_byte"))
    assert bits.recorded == repr(EVAL_REPORT["bits_per_byte"])


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("bits_per_byte", math.nextafter(EVAL_REPORT["bits_per_byte"], 0.0), "2.4805891062331393"),  # one float apart
    ("loss", math.nextafter(EVAL_REPORT["loss"], 2.0), "1.7193866729736331"),
    ("tokens", 8191, "8191"),
    ("split", "train", "train"),
])
def test_a_report_one_bit_apart_differs_naming_the_field_and_both_values(tmp_path, field, value, shown):
    plan = _signed_plan(tmp_path)
    compared = compare_eval_report(plan.eval_report, {**EVAL_REPORT, field: value})
    [differs] = [c for c in compared if not c.same]
    recorded = EVAL_REPORT[field]
    assert str(differs) == (f"evaluate: evaluation report {field} differs: recorded "
                            f"{recorded if isinstance(recorded, str) else repr(recorded)}, re-derived {shown}")


def test_a_report_of_another_training_manifest_or_lacking_a_field_differs(tmp_path):
    plan = _signed_plan(tmp_path)
    other = compare_eval_report(plan.eval_report, {**EVAL_REPORT, "training_manifest_sha256": "8" * 64},
                                training_manifest=("9" * 64, H))
    assert [str(c) for c in other if not c.same] == [
        f"evaluate: evaluation report training_manifest_sha256 differs: recorded {H}, re-derived {'8' * 64}"]
    lacking = compare_eval_report(plan.eval_report, {k: v for k, v in EVAL_REPORT.items() if k != "windows"})
    assert [c.derived for c in lacking if not c.same] == ["none: not in the report"]


def test_the_folder_compares_every_file_with_its_signed_subject(tmp_path):
    plan = _signed_plan(tmp_path)
    copy = tmp_path / "derived"
    shutil.copytree(tmp_path / "a" / "artifacts" / "hf_model", copy)
    same = compare_folder(plan.hf_files, artifact_files(copy), prefix="artifacts/hf_model")
    assert [(c.step, c.input, c.same) for c in same] == [("hf-folder", "artifacts/hf_model/config.json", True),
                                                          ("hf-folder", "artifacts/hf_model/model.safetensors", True)]
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 1]))
    (copy / "generation_config.json").write_text("{}")
    (copy / "config.json").unlink()
    found = {c.input.rsplit("/", 1)[1]: c for c in compare_folder(plan.hf_files, artifact_files(copy),
                                                                   prefix="artifacts/hf_model")}
    assert str(found["model.safetensors"]) == (
        f"hf-folder: artifacts/hf_model/model.safetensors differs: recorded {plan.hf_files['model.safetensors']}, "
        f"re-derived {sha256_file(weights)}")
    assert found["config.json"].derived == "none: the re-derived export did not write it"
    assert found["generation_config.json"].recorded == "none: not a file of the registered folder"
    assert not any(c.same for c in found.values())


# ------------------------------------------------------------------------------- at another world size


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_world_size_that_splits_the_recorded_global_batch_is_accepted(world_size):
    check_world_size(RECIPE, world_size)  # tiny: 16 samples per step, micro-batches of 8


@pytest.mark.parametrize(("world_size", "share"), [(3, 24), (4, 32)])
def test_a_world_size_that_does_not_split_the_global_batch_is_refused_naming_both_numbers(world_size, share):
    with pytest.raises(ConfigError, match=rf"--world-size {world_size} cannot split the recorded global batch: "
                                          rf"data.global_batch_size = 16 does not divide by world size x "
                                          rf"data.micro_batch_size = {world_size} x 8 = {share}"):
        check_world_size(RECIPE, world_size)


def _gpt_folder(folder: Path, state: dict) -> Path:
    """kiln's GPT state as a registered version's Hugging Face folder holds it (kiln_trainer.hf's mapping)."""
    from safetensors.torch import save_file

    from kiln_trainer.hf import gpt2_state_dict

    folder.mkdir(parents=True)
    save_file(gpt2_state_dict(state, RECIPE["model"]), str(folder / "model.safetensors"))
    return folder


def _gpt_state() -> dict:
    import torch

    from kiln_trainer.config import ModelConfig
    from kiln_trainer.model import build_model

    torch.manual_seed(0)
    model = {k: v for k, v in RECIPE["model"].items() if k in {f.name for f in dataclasses.fields(ModelConfig)}}
    return {k: v.detach().clone() for k, v in build_model(ModelConfig(**model)).state_dict().items()}


def test_the_same_weights_through_the_export_differ_by_nothing(tmp_path):
    state = _gpt_state()
    same = compare_weights(load_folder_weights(_gpt_folder(tmp_path / "a", state)),
                           load_folder_weights(_gpt_folder(tmp_path / "b", state)),
                           tolerance=0.0, world_size=2, recorded_world_size=1)
    assert same.within and same.max_abs_diff == 0.0 and same.tensor == ""
    # every GPT-2 tensor of the folder (the zero biases of a bias-free GPT included), the tied head once
    assert same.tensors == len(load_folder_weights(tmp_path / "a")) and same.values > 100_000
    assert "every one of" in str(same) and "largest absolute difference 0" in str(same)


def test_a_perturbed_weight_is_caught_and_named_with_both_values(tmp_path):
    state = _gpt_state()
    perturbed = {k: v.clone() for k, v in state.items()}
    name = "transformer.h.1.mlp.c_fc.weight"  # a Linear weight: [out, in] here, transposed in the folder
    before = float(perturbed[name][5, 3])
    perturbed[name][5, 3] += 4 * DEFAULT_TOLERANCE
    registered = load_folder_weights(_gpt_folder(tmp_path / "registered", state))
    derived = load_folder_weights(_gpt_folder(tmp_path / "derived", perturbed))
    caught = compare_weights(registered, derived, tolerance=DEFAULT_TOLERANCE, world_size=2, recorded_world_size=1)
    assert not caught.within
    assert (caught.tensor, caught.index) == (name, (3, 5))  # GPT-2's Conv1D holds it as [in, out]
    assert caught.max_abs_diff == pytest.approx(4 * DEFAULT_TOLERANCE, rel=1e-3)
    assert caught.registered == pytest.approx(before) and caught.derived == pytest.approx(before + 4 * DEFAULT_TOLERANCE)
    text = str(caught)
    assert text.startswith("train: weights at world size 2 (the version was trained at 1): largest absolute difference ")
    assert f"exceeds the bound {DEFAULT_TOLERANCE:g}, in {name}[3, 5]: registered " in text and "re-derived " in text
    # the same difference under a looser bound reproduces
    loose = compare_weights(registered, derived, tolerance=1e-2, world_size=2, recorded_world_size=1)
    assert loose.within and loose.tensor == name and "within the bound 0.01" in str(loose)


def test_weights_that_cannot_be_compared_never_reproduce():
    import torch

    a = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    for derived, problem in (({"w": torch.zeros(2, 3)}, "tensors only in the registered weights: ['b']"),
                             ({"w": torch.zeros(3, 2), "b": torch.zeros(3)}, "w is torch.float32 [2, 3] registered"),
                             ({"w": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(3)}, "torch.float64")):
        found = compare_weights(a, derived, tolerance=1.0, world_size=2, recorded_world_size=1)
        assert not found.within and problem in found.problem and "cannot be compared" in str(found)


def test_a_nan_where_the_registered_weight_is_a_number_is_an_infinite_difference():
    import torch

    nan = compare_weights({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, float("nan")])}, tolerance=1e6,
                          world_size=2, recorded_world_size=1)
    assert not nan.within and nan.max_abs_diff == float("inf") and nan.index == (1,)
    # the record (and the attestation's canonical JSON) holds no NaN nor infinity: JSON has neither
    assert json.loads(json.dumps(nan.to_json(), allow_nan=False))["max_abs_diff"] == "inf"
    assert canonical_json(nan.to_json())
    both = compare_weights({"w": torch.tensor([float("nan")])}, {"w": torch.tensor([float("nan")])}, tolerance=0.0,
                           world_size=2, recorded_world_size=1)
    assert both.within


def _sample_logs(run_dir: Path, batches: list[list[int]], world_size: int) -> None:
    logs = run_dir / "sample-log"
    logs.mkdir(parents=True)
    share = len(batches[0]) // world_size
    for rank in range(world_size):
        lines = [json.dumps({"step": step, "rank": rank, "world_size": world_size,
                             "sample_ids": ids[rank * share:(rank + 1) * share]}) for step, ids in enumerate(batches)]
        (logs / f"rank-{rank:05d}.jsonl").write_text("".join(line + "\n" for line in lines))


def test_the_data_order_at_another_world_size_is_checked_against_the_one_seed_and_step_give(tmp_path):
    from kiln_trainer.sample_order import SampleOrder

    shards, seed, steps = [30, 25, 40], 1337, 9  # 144 samples read of 95: the batches cross an epoch
    expected = [SampleOrder(shards, seed=seed).ids_range(s * 16, 16).tolist() for s in range(steps)]
    order = {"shard_samples": shards, "seed": seed, "window_shards": 0, "global_batch_size": 16, "steps": steps,
             "world_size": 2}
    _sample_logs(tmp_path / "same", expected, 2)
    same, where = data_order(tmp_path / "same", **order)
    assert same.same and where == "" and same.step == "train" and same.input.startswith("data order (9 global batches")
    swapped = [*expected[:4], expected[4][8:] + expected[4][:8], *expected[5:]]  # step 5's two halves swapped
    _sample_logs(tmp_path / "swapped", swapped, 2)
    differs, where = data_order(tmp_path / "swapped", **order)
    assert not differs.same and differs.recorded == same.recorded
    assert where.startswith("the global batch of step 5 was read by ranks [0, 1]")
    nothing, where = data_order(tmp_path / "none", **order)
    assert not nothing.same and nothing.derived.startswith("none: the trainer logged no sample ids")


def test_a_mixture_s_data_order_at_another_world_size_is_the_mixture_draw_s(tmp_path):
    from kiln_trainer.mixture import Mixture, MixtureSource

    sources = [("code", 0.7, [30, 25]), ("prose", 0.3, [12, 9, 20])]
    seed, steps = 5, 7
    draw = Mixture([MixtureSource(*s) for s in sources], seed=seed)
    expected = [draw.draw_range(s * 8, 8).global_ids.tolist() for s in range(steps)]
    order = {"shard_samples": [], "sources": sources, "seed": seed, "window_shards": 0, "global_batch_size": 8,
             "steps": steps, "world_size": 2}
    _sample_logs(tmp_path / "same", expected, 2)
    same, where = data_order(tmp_path / "same", **order)
    assert same.same and where == ""
    # the same logs against one source's order (what a mixture's check must not fall back to) differ
    plain, _ = data_order(tmp_path / "same", **{**order, "sources": None, "shard_samples": [30, 25, 12, 9, 20]})
    assert not plain.same
    swapped = [*expected[:2], expected[2][4:] + expected[2][:4], *expected[3:]]
    _sample_logs(tmp_path / "swapped", swapped, 2)
    differs, where = data_order(tmp_path / "swapped", **order)
    assert not differs.same and where.startswith("the global batch of step 3 was read by ranks [0, 1]")


def _at_two(verdict, weights, reason=""):
    return Reproduction(model="m", version="3", policy="sandbox", verdict=verdict, reason=reason,
                        comparisons=(Comparison("snapshot", "snapshot x", "a", "a"),
                                     Comparison("train", "data order (...)", "b", "b")),
                        world_size=2, recorded_world_size=1, tolerance=weights.tolerance, weights=weights)


def test_a_reproduction_within_tolerance_says_so_in_words_tags_and_attestation():
    weights = WeightsDifference(world_size=2, recorded_world_size=1, tolerance=1e-4, max_abs_diff=2e-7,
                                tensor="transformer.h.0.attn.c_attn.weight", index=(3, 4), registered=0.5,
                                derived=0.5000002, tensor_max_abs=0.9, tensors=28, values=120640,
                                derived_weights_sha256="f" * 64)
    outcome = _at_two("reproduced", weights)
    text = "\n".join(outcome.in_words())
    assert "reproduced within tolerance at world size 2 (the version was trained at 1)" in text
    assert "largest absolute difference 2e-07, within the bound 0.0001" in text and "bitwise" not in text
    assert outcome.summary.startswith("within tolerance at world size 2: train: weights at world size 2")
    assert verdict_size_tags(outcome) == {"kiln.reproduction.world_size": "2", "kiln.reproduction.weights_compared":
                                          "tolerance", "kiln.reproduction.tolerance": "0.0001",
                                          "kiln.reproduction.max_abs_diff": "2e-07"}
    statement = attestation_statement(outcome, "d" * 64)
    assert {"name": "weights", "digest": {"sha256": "f" * 64}} in statement["subject"]
    predicate = statement["predicate"]
    assert (predicate["worldSize"], predicate["recordedWorldSize"], predicate["weightsCompared"],
            predicate["tolerance"]) == (2, 1, "tolerance", 1e-4)
    assert predicate["weights"]["max_abs_diff"] == 2e-7 and predicate["weights"]["within"] is True
    assert predicate["verdict"] == "reproduced" and predicate["comparisons"][1]["input"].startswith("data order")
    assert json.loads(json.dumps(outcome.to_json()))["weights"]["tensor"] == "transformer.h.0.attn.c_attn.weight"


def test_a_reproduction_beyond_tolerance_names_the_tensor_and_both_values():
    weights = WeightsDifference(world_size=2, recorded_world_size=1, tolerance=1e-4, max_abs_diff=3e-3,
                                tensor="lm_head.weight", index=(7, 1), registered=0.25, derived=0.253,
                                tensor_max_abs=1.5, tensors=3, values=99)
    outcome = _at_two("differs", weights, reason=str(weights))
    text = "\n".join(outcome.in_words())
    assert "does not reproduce within tolerance at world size 2 (the version was trained at 1)" in text
    assert "largest absolute difference 0.003 exceeds the bound 0.0001, in lm_head.weight[7, 1]: registered 0.25, " \
           "re-derived 0.253 (the tensor's largest magnitude 1.5)" in text


def test_a_bitwise_reproduction_keeps_its_words_and_tags_no_bound():
    outcome = Reproduction(model="m", version="3", policy="sandbox", verdict="reproduced", world_size=1,
                           recorded_world_size=1)
    assert outcome.in_words()[0].endswith("reproduced: every step gave the recorded digest, the weights the same sha256, "
                                          "the evaluation the same report bit for bit and the Hugging Face folder the "
                                          "same files")
    assert verdict_size_tags(outcome) == {"kiln.reproduction.world_size": "1",
                                          "kiln.reproduction.weights_compared": "bitwise"}
    predicate = attestation_statement(outcome, "d" * 64)["predicate"]
    assert predicate["weightsCompared"] == "bitwise" and predicate["tolerance"] is None and predicate["weights"] is None


def test_a_tolerance_without_another_world_size_is_refused_before_the_registry_is_asked(capsys):
    with pytest.raises(ConfigError, match="--tolerance bounds the weights' difference at another world size"):
        reproduce("m", "3", by="version", policy="sandbox", tolerance=1e-3)
    assert kiln_main(["reproduce", "m/3", "--tolerance", "1e-3"]) == 2
    assert "give --world-size N" in capsys.readouterr().err
    for bad in (["--world-size", "0"], ["--world-size", "two"], ["--world-size", "2", "--tolerance", "nan"],
                ["--world-size", "2", "--tolerance", "-1"]):
        with pytest.raises(SystemExit) as exc:
            kiln_main(["reproduce", "m/3", *bad])
        assert exc.value.code == 2

"""The stages of a kiln run as plain functions: typed refs in, typed refs out; the adapter serialises them.

The refs are ``kiln.refs``' (and ``kiln.launchers``' ``LaunchPlan`` and ``JobHandle`` for a launched
job): frozen dataclasses with ``to_json``/``from_json``. ``kiln.airflow.dagfactory`` turns an upstream
task's XCom into its ref before a stage sees it, and a stage's answer into an XCom; a malformed XCom
fails the task there, without retry (``ManifestError``). A writing stage still trusts the run's own
records, never the ref an XCom carried (``records``).

One module per stage (or group of stages); this package re-exports what the DAG tasks, the demo and
the CLI call::

    inputs       the run's conf checked in its first task; the contract it validates with; the training
                 inputs its params make
    records      what a writing stage trusts: the run's own records, never an XCom's word
    snapshot     snapshot_stage
    validation   shard_batches, validate_stage, data_gate_stage
    mixture      a mixture run's sources through snapshot, validation and the data gate, and the DAG's
                 data tasks for either kind of run (snapshot_run_stage, run_shard_batches,
                 validate_run_stage, data_gate_run_stage)
    tokenize     tokenizer_stage, token_parts, tokenize_stage (mapped), tokens_stage: packed token shards
    training     prepare_train / submit_train / finish_train (deferred), train_stage (in-process),
                 straggler handling, cancel_live_job (the DAG's failure callback)
    evaluation   evaluate_stage
    promotion    register_stage, model_gate_stage, review_stage, promote_stage, outcome_stage
    champion_watch   the daily re-evaluation of the champion and its reviewed rollback

Each DAG task calls exactly one of these (``kiln.airflow.dagfactory`` is only wiring), and each is a
transaction keyed by the run: calling it again with the same inputs changes nothing the second time
(the snapshot id is content-derived, training resumes from its committed checkpoint or returns the
finished result, registration and promotion look up what they wrote before).

No Airflow here. Heavy libraries (dvc, great_expectations, mlflow, torch) load inside the stages.
"""

from __future__ import annotations

from kiln.stages.evaluation import evaluate_stage
from kiln.stages.inputs import TRAIN_PARAMS, check_run_conf, load_run_recipe, run_policy, train_inputs
from kiln.stages.mixture import (
    MIXTURE_PARAM,
    data_gate_run_stage,
    run_shard_batches,
    snapshot_run_stage,
    validate_run_stage,
)
from kiln.stages.promotion import (
    model_gate_stage,
    outcome_stage,
    promote_stage,
    register_stage,
    review_in_words,
    review_stage,
    write_summary,
)
from kiln.stages.snapshot import snapshot_stage
from kiln.stages.tokenize import TOKENS_REMOTE_ENV, token_parts, tokenize_stage, tokenizer_stage, tokens_stage
from kiln.stages.training import (
    cancel_live_job,
    exclude_straggler,
    finish_train,
    prepare_train,
    straggler_watch,
    submit_train,
    train_stage,
)
from kiln.stages.validation import data_gate_stage, shard_batches, validate_stage

__all__ = [
    "MIXTURE_PARAM",
    "TOKENS_REMOTE_ENV",
    "TRAIN_PARAMS",
    "cancel_live_job",
    "check_run_conf",
    "data_gate_run_stage",
    "data_gate_stage",
    "evaluate_stage",
    "exclude_straggler",
    "finish_train",
    "load_run_recipe",
    "model_gate_stage",
    "outcome_stage",
    "prepare_train",
    "promote_stage",
    "register_stage",
    "run_policy",
    "run_shard_batches",
    "review_in_words",
    "review_stage",
    "shard_batches",
    "snapshot_run_stage",
    "snapshot_stage",
    "token_parts",
    "tokenize_stage",
    "tokenizer_stage",
    "tokens_stage",
    "straggler_watch",
    "submit_train",
    "train_inputs",
    "train_stage",
    "validate_run_stage",
    "validate_stage",
    "write_summary",
]

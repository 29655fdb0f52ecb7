"""Shard validation against a data contract, quarantine, and the data gate.

    validate_shard(path, contract, eval_doc_hashes) -> ShardReport     one shard, never raises on data
    validate_shards(paths, ...) / validate_directory(corpus_dir, ...)  batches: one GE run per batch
    skipped_train_entries(corpus_dir) -> [SkippedEntry]                 what in train/ is not a shard (named in reports)
    load_eval_doc_hashes(corpus_dir) -> EvalDocHashes                   the eval split, for the contamination rule
    cross_shard_duplicates(reports) -> reports                          snapshot rule: ids unique across shards
    drop_near_duplicates(reports, contract) -> reports                  snapshot rule: near-duplicate documents dropped
    drop_rows(report) -> [row]                                          the rows a contract dropped (left out of training)
    gate(reports, max_quarantine_share)                                 DataGateError (no retry) above threshold
    build_training_manifest(...) -> TrainingManifest                    healthy shards only
    write_quarantine_report(reports, path)                              every shard with its verdict (JSON)
    publish_quarantine_report(reports, out_dir, ...)                    JSON + HTML page, logged to MLflow

The modules, in the order a shard meets them:

    shards       which entries of train/ are shards, and reading one (a regular file, never a link)
    eval_split   the eval split's text hashes the contamination rule compares rows with
    suite        the one GE context per process, and the GE suite of a contract
    frames       a shard as the frame GE checks: Arrow-backed strings, the contract's derived columns
    patterns     what a regex can match: required literals (the secret-rule prefilter), RE2 spellings
    one_shard    one shard, one GE run: the reference semantics
    stacking     a batch's shards in one GE run, each result charged back to its shard
    dropped      documents dropped by the contract's document rules and near-duplicate removal
    reasons      a report's reasons, with short and redacted samples
    validate     the entry points above: one shard, a batch, a corpus directory
    cross_shard  the snapshot rule: a doc id in one healthy shard only
    data_gate    the gate, the quarantined share, and the TrainingManifest of what passed
    report       the quarantine report (JSON, HTML page) and its publication to MLflow

A quarantined shard is a value (``ShardReport(verdict="quarantined")``), never an exception: bad
*data* must not crash a worker. Exceptions are for faults: a contract GE cannot parse
(``ContractError``), a gate breach (``DataGateError``). A shard path that is not a regular file (a
FIFO that would block the reader for ever, a device, a symlink to bytes elsewhere) is quarantined
without being opened.

great_expectations and pandas are imported on first use, so importing this package stays cheap
(DAG files and the CLI's ``--help`` import it). One ephemeral GE context is built per process and
reused by every validation (measured on the 2-core dev box: ~3 s import, ~55 ms per validation after that). Since that
fixed cost dwarfs a small shard's rows, ``validate_shards`` stacks a batch's shards into one GE run
and maps the results back to each shard (``stacking``); ``validate_shard`` is the one-shard
reference the batched path is tested against.
"""

from kiln.data.validation.cross_shard import CROSS_SHARD_RULE, cross_shard_duplicates
from kiln.data.validation.data_gate import build_training_manifest, gate, quarantined_share
from kiln.data.validation.dropped import DROPPED_SHARE_RULE, NEAR_DUPLICATE_RULE, drop_near_duplicates, drop_rows
from kiln.data.validation.eval_split import EvalDocHashes, load_eval_doc_hashes
from kiln.data.validation.report import (
    publish_quarantine_report,
    quarantine_report,
    render_quarantine_html,
    write_quarantine_html,
    write_quarantine_report,
)
from kiln.data.validation.shards import (
    READABLE_RULE,
    TRAIN_GLOB,
    SkippedEntry,
    eval_shards,
    skipped_train_entries,
    train_shards,
)
from kiln.data.validation.validate import validate_directory, validate_shard, validate_shards

__all__ = [
    "CROSS_SHARD_RULE",
    "DROPPED_SHARE_RULE",
    "NEAR_DUPLICATE_RULE",
    "READABLE_RULE",
    "TRAIN_GLOB",
    "EvalDocHashes",
    "SkippedEntry",
    "build_training_manifest",
    "cross_shard_duplicates",
    "drop_near_duplicates",
    "drop_rows",
    "eval_shards",
    "gate",
    "load_eval_doc_hashes",
    "publish_quarantine_report",
    "quarantine_report",
    "quarantined_share",
    "render_quarantine_html",
    "skipped_train_entries",
    "train_shards",
    "validate_directory",
    "validate_shard",
    "validate_shards",
    "write_quarantine_html",
    "write_quarantine_report",
]

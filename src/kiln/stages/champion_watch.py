"""Scheduled re-evaluation of the serving champion, and the alias rollback it may propose.

A champion was promoted on an evaluation made once, on the held-out split of the snapshot it was
trained on. The data it serves moves on; that number goes stale. The ``kiln_champion_watch`` DAG
(``kiln.airflow.dagfactory.build_champion_watch_dag``) runs these stages on the policy's
``champion_watch_cron``::

    reevaluate_stage     pin the registered corpus as it is now (DVC snapshot), evaluate the
                         ``champion`` and ``previous`` versions' checkpoints on its held-out split
    watch_decision       pure: the champion regressed beyond ``policy.gate.max_regression`` (against
                         its recorded evaluation, or against ``previous`` on today's split)?
                         → ``propose_rollback`` | ``ok`` | ``regressed_no_fallback`` | ``no_champion``
    rollback_review_stage  [in the HITL review task: the policy's reviewers; a timeout rejects]
                         records the answer on the champion version (``kiln.rollback_review*``)
    rollback_stage       only on that recorded approval, and only if neither alias moved since
                         the proposal: ``kiln.registry.rollback`` (audit tags: who, when, why)
    watch_outcome_stage  says what happened; fails the run when the champion regressed and no
                         version does better (a human must act: retrain or investigate)

No Airflow here. Reads of the registry are plain ``MlflowClient`` calls; the only writes are the
registry's audited ``record_rollback_review`` and ``rollback``. The evaluation is the trainer's own entry point
(``python -m kiln_trainer.evaluate``), the one the pipeline's evaluate stage uses, so today's
number and the recorded one are computed the same way.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

from kiln import runs
from kiln import settings as kiln_settings
from kiln.errors import ConfigError, ManifestError, PolicyError, RegistryError, RunMismatchError
from kiln.policy import Policy
from kiln.refs import (
    ApprovalAnswer,
    ChampionEvaluation,
    PinnedMixture,
    PinnedSnapshot,
    Review,
    RollbackRecord,
    TrainingManifest,
    VersionEvaluation,
    WatchAction,
    WatchDecision,
    WatchOutcome,
    sha256_file,
)
from kiln.util.fs import atomic_write_text, read_own_json
from kiln_trainer.contract import MANIFEST_NAME

log = logging.getLogger("kiln.stages.champion_watch")

PREVIOUS_ALIAS = "previous"
"""== ``kiln.registry.PREVIOUS_ALIAS`` (the holder before the last promotion)."""
ACTIONS: tuple[WatchAction, ...] = typing.get_args(WatchAction)


def _client():
    from mlflow import MlflowClient

    uri = kiln_settings.load().mlflow_uri
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _by_alias(client: Any, model: str, alias: str) -> Any:
    """The version holding ``alias`` (None: nobody holds it, or the model does not exist yet)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(model, alias)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(exc).lower():
            return None
        raise RegistryError(f"reading {model}@{alias}: {exc}") from exc


def aliases(policy: Policy) -> dict[str, str | None]:
    """``{"champion": version, "previous": version}`` of the policy's target model (None: unset)."""
    client = _client()
    return {
        name: (None if mv is None else str(mv.version))
        for name, mv in (("champion", _by_alias(client, policy.target_model, policy.alias)),
                         ("previous", _by_alias(client, policy.target_model, PREVIOUS_ALIAS)))
    }


# ----------------------------------------------------------------------------------- re-evaluate
def heldout_manifest(snapshot: PinnedSnapshot | PinnedMixture, policy: Policy, out: Path) -> Path:
    """A TrainingManifest of the pinned snapshot for evaluation: its held-out ``eval/`` split; of a
    mixture (production's ``[mixture]``), format 2 with every source's held-out split, as the run's
    evaluate stage scored the champion on (the evaluator reads them all, in declared order).

    Only ``eval_shards`` are read by the evaluator. ``shards`` lists the snapshot's training files
    (path, sha256, rows) because the trainer's manifest reader refuses an empty list; nothing trains
    from this manifest."""
    if isinstance(snapshot, PinnedMixture):
        from kiln.stages.mixture import run_sources

        entries = []
        for source in run_sources(policy, {}, snapshot):
            train, eval_shards = _heldout_shards(source.snapshot)
            entries.append({"name": source.name, "weight": source.weight, "corpus": source.snapshot.corpus,
                            "snapshot_id": source.snapshot.id, "contract": source.contract, "shards": train,
                            "eval_shards": eval_shards, "quarantined": []})
        manifest = TrainingManifest.build_mixture(entries)
    else:
        train, eval_shards = _heldout_shards(snapshot)
        manifest = TrainingManifest.build(snapshot_id=snapshot.id, corpus=snapshot.corpus, contract=policy.contract,
                                          shards=train, eval_shards=eval_shards, quarantined=[])
    return manifest.write(out / runs.HELDOUT_MANIFEST)


def _heldout_shards(snapshot: PinnedSnapshot) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The snapshot's readable training shards and its held-out ``eval/`` shards (path, sha256, rows)."""
    import pyarrow.parquet as pq

    root = Path(snapshot.path)

    def entry(path: Path) -> dict[str, Any] | None:
        try:  # an unreadable training shard (the data gate would quarantine it) is simply not listed
            return {"path": str(path), "sha256": sha256_file(path), "rows": int(pq.read_metadata(path).num_rows)}
        except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
            return None

    eval_shards = [entry(p) for p in sorted((root / "eval").glob("*.parquet"))]
    if not eval_shards or None in eval_shards:
        raise ConfigError(f"snapshot {snapshot.id} of corpus {snapshot.corpus!r} has no readable held-out "
                          "split under eval/")
    train = [e for e in (entry(root / s) for s in snapshot.shards) if e is not None]
    if not train:
        raise ConfigError(f"snapshot {snapshot.id} has no readable training shard to list")
    return train, [e for e in eval_shards if e is not None]


def evaluate_version(model: str, version: str, manifest: Path, out: Path) -> VersionEvaluation:
    """Today's held-out evaluation of one registered version's checkpoint (its ``kiln.checkpoint``
    tag), next to the evaluation recorded in its tags. The checkpoint must be the weights the
    version was registered with (``kiln.weights_sha256``), or the comparison would be about
    another model."""
    from kiln.registry import version_report

    recorded = version_report(model, version)
    step_dir = Path(recorded.checkpoint)
    if not (step_dir / MANIFEST_NAME).is_file():
        raise ConfigError(
            f"{model} version {version}: its checkpoint {step_dir} is not available here (pruned, or on "
            "another machine); cannot re-evaluate it"
        )
    if not out.is_file():
        proc = subprocess.run(
            [sys.executable, "-m", "kiln_trainer.evaluate", "--checkpoint", str(step_dir), "--manifest", str(manifest),
             "--out", str(out)],
            capture_output=True, text=True,
        )
        for line in (proc.stdout + proc.stderr).splitlines()[-10:]:
            log.info("[evaluate v%s] %s", version, line)
        if proc.returncode != 0:
            raise RegistryError(
                f"re-evaluation of {model} version {version} failed (exit {proc.returncode}): {proc.stderr[-1500:]}"
            )
    report = read_own_json(out)
    if report["weights_sha256"] != recorded.weights_sha256:
        raise ManifestError(
            f"{model} version {version}: checkpoint {step_dir} holds weights {report['weights_sha256'][:16]}…, "
            f"the version was registered with {recorded.weights_sha256[:16]}…"
        )
    evaluated_on = TrainingManifest.read(manifest)
    made = {"checkpoint": report.get("checkpoint"), "training_manifest_sha256": report.get("training_manifest_sha256")}
    asked = {"checkpoint": str(step_dir.resolve()), "training_manifest_sha256": evaluated_on.sha256}
    differing = sorted(k for k in made if made[k] != asked[k])
    if differing:  # an earlier try's report, of another held-out split (the corpus moved since)
        raise RunMismatchError(
            f"{model} version {version}: evaluation report {out} was made from other inputs than this try asks for: "
            + "; ".join(f"{k}: made {made[k]!r}, asked {asked[k]!r}" for k in differing) + " (not reusing it)"
        )
    return VersionEvaluation(
        version=str(version),
        recorded_bits_per_byte=float(recorded.bits_per_byte),
        recorded_snapshot_id=recorded.snapshot_id,
        current_bits_per_byte=float(report["bits_per_byte"]),
        current_tokens=int(report["tokens"]),
        checkpoint=str(step_dir),
    )


def reevaluate_stage(policy: Policy, key: str) -> ChampionEvaluation:
    """Evaluate ``champion`` and ``previous`` on the held-out split of the registered corpus (of
    every source of production's mixture) as it is now. Read-only towards the registry; idempotent
    per run (reports are kept in the run dir)."""
    from kiln.stages.mixture import snapshot_run_stage

    held = aliases(policy)
    if held["champion"] is None:
        return ChampionEvaluation(model=policy.target_model, alias=policy.alias)
    snapshot = snapshot_run_stage(policy, {})
    out = runs.run_dir(key)
    manifest = heldout_manifest(snapshot, policy, out)
    champion = evaluate_version(policy.target_model, held["champion"], manifest,
                                out / runs.version_eval_report(held["champion"]))
    previous = None
    if held["previous"] is not None and held["previous"] != held["champion"]:
        previous = evaluate_version(policy.target_model, held["previous"], manifest,
                                    out / runs.version_eval_report(held["previous"]))
    result = ChampionEvaluation(model=policy.target_model, alias=policy.alias, champion=champion, previous=previous,
                                snapshot_id=snapshot.id)
    atomic_write_text(out / runs.REEVALUATION, json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    return result


# -------------------------------------------------------------------------------------- decision
def watch_decision(evaluation: ChampionEvaluation, tolerance: float) -> WatchDecision:
    """Did the champion regress beyond ``tolerance`` (bits per byte, absolute), and is there a
    version to roll back to? Pure; every number that decided is in the answer.

    Regressed: today's bits per byte exceed the recorded ones by more than ``tolerance``, or exceed
    ``previous``'s on today's split by more than ``tolerance``. A rollback is proposed only when
    ``previous`` does better than the champion on today's split."""
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise ConfigError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    champion, previous = evaluation.champion, evaluation.previous
    if champion is None:
        return WatchDecision(model=evaluation.model, alias=evaluation.alias, tolerance=tolerance,
                             snapshot_id=evaluation.snapshot_id, champion_version=None,
                             previous_version=previous.version if previous else None, action="no_champion",
                             reasons=[f"nobody holds {evaluation.alias}: nothing to watch"])
    now, recorded = champion.current_bits_per_byte, champion.recorded_bits_per_byte
    reasons = []
    drift = now - recorded if math.isfinite(now) else math.inf
    regressed = drift > tolerance
    reasons.append(
        f"{'REGRESSED' if regressed else 'ok'}: champion v{champion.version} {now:.4f} bits/byte on today's held-out "
        f"split vs {recorded:.4f} recorded at promotion ({drift:+.4f}, tolerance {tolerance})"
    )
    better_previous = False
    if previous:
        gap = now - previous.current_bits_per_byte if math.isfinite(now) else math.inf
        behind = gap > tolerance
        regressed = regressed or behind
        better_previous = gap > 0
        reasons.append(
            f"{'REGRESSED' if behind else 'ok'}: previous v{previous.version} {previous.current_bits_per_byte:.4f} "
            f"bits/byte on the same split (champion {gap:+.4f})"
        )
    else:
        reasons.append("no previous version to compare with or roll back to")
    action: WatchAction
    if not regressed:
        action = "ok"
    elif better_previous and previous:  # (better_previous implies a previous)
        action = "propose_rollback"
        reasons.append(f"propose: move {evaluation.alias} back to v{previous.version}")
    else:
        action = "regressed_no_fallback"
        reasons.append("no version does better on today's split: retrain or investigate the data")
    return WatchDecision(
        model=evaluation.model, alias=evaluation.alias, tolerance=tolerance, snapshot_id=evaluation.snapshot_id,
        champion_version=champion.version, previous_version=previous.version if previous else None,
        action=action, reasons=reasons, champion_current_bits_per_byte=now, champion_recorded_bits_per_byte=recorded,
        previous_current_bits_per_byte=previous.current_bits_per_byte if previous else None,
    )


# -------------------------------------------------------------------------------------- rollback
def rollback_review_stage(policy: Policy, proposal: WatchDecision, answer: ApprovalAnswer, key: str) -> Review:
    """Record watch run ``key``'s review of its proposed rollback on the version it would demote:
    called inside the ``rollback_approval`` task, with the answer Airflow handed it, this is the one
    approval ``rollback_stage`` accepts. An Approve from someone who is not a reviewer is refused."""
    from kiln.registry import record_rollback_review
    from kiln.stages import review_in_words

    if proposal.action != "propose_rollback":
        raise PolicyError(f"nothing was proposed to review: the watch decided {proposal.action!r}")
    outcome, reviewer, at = review_in_words(policy, answer)
    return record_rollback_review(
        policy=policy, from_version=str(proposal.champion_version), to_version=str(proposal.previous_version),
        run_key=key, outcome=outcome, reviewer=reviewer, at=at, comment=answer.comment or "",
    )


def rollback_stage(policy: Policy, proposal: WatchDecision, key: str) -> RollbackRecord:
    """Roll ``policy.alias`` back to ``previous``, after a reviewer approved the proposal.

    The approval is the one this run's review task recorded on the champion version
    (``kiln.registry.rollback_approval``: a reviewer's Approve of exactly this rollback, in this
    run), never an XCom or a task marked success. Refuses (``PolicyError``, no retry) without it,
    and when either alias moved since the proposal (a promotion or another rollback in between):
    the approval was about other versions. A re-run after success changes nothing
    (``kiln.registry.rollback`` is idempotent)."""
    from kiln.registry import rollback, rollback_approval

    if proposal.action != "propose_rollback":
        raise PolicyError(f"nothing to roll back: the watch decided {proposal.action!r}")
    wanted_champion, wanted_previous = str(proposal.champion_version), str(proposal.previous_version)
    review = rollback_approval(policy, wanted_champion, wanted_previous, key)
    held = aliases(policy)
    already = held["champion"] == wanted_previous and held["previous"] == wanted_previous
    if not already and (held["champion"], held["previous"]) != (wanted_champion, wanted_previous):
        raise PolicyError(
            f"{policy.target_model} aliases moved since the proposal (then {policy.alias}=v{wanted_champion}, "
            f"{PREVIOUS_ALIAS}=v{wanted_previous}; now {policy.alias}=v{held['champion']}, "
            f"{PREVIOUS_ALIAS}=v{held['previous']}): not rolling back; the next watch run re-evaluates"
        )
    reason = (
        f"champion watch {key}: v{wanted_champion} at {proposal.champion_current_bits_per_byte:.4f} bits/byte on "
        f"snapshot {proposal.snapshot_id} (recorded {proposal.champion_recorded_bits_per_byte:.4f}); "
        f"v{wanted_previous} at {proposal.previous_current_bits_per_byte:.4f}"
    )
    record = rollback(policy.target_model, policy, review.reviewer, reason=reason)
    return RollbackRecord(**record.to_json(), reason=reason)


def watch_outcome_stage(
    policy: Policy, proposal: WatchDecision | None, rolled_back: RollbackRecord | None, key: str,
) -> WatchOutcome:
    """How the watch ended, in words (``summary.json`` in the run dir); a review as the registry
    recorded it. Fails the run (``PolicyError``, no retry) when the champion regressed and nothing
    better exists: that needs a person."""
    from kiln.registry import recorded_review
    from kiln.stages import write_summary

    if proposal is None:
        raise ConfigError("the regression gate left no decision")
    if rolled_back:
        message = (f"ROLLED BACK {rolled_back.registered_model}@{rolled_back.alias} to v{rolled_back.version} "
                   f"(from v{rolled_back.previous_version}), approved by {rolled_back.approver}")
    elif proposal.action == "propose_rollback":
        review = recorded_review(policy, str(proposal.champion_version), key, kind="rollback")
        if review is None or review.outcome == "timed out":
            why = f"nobody answered within {policy.approval_timeout_s} s (assigned: {', '.join(policy.reviewers)})"
        else:
            why = f"{review.outcome} by {review.reviewer}"
        message = f"rollback proposed but NOT applied: {why}; {policy.alias} unchanged"
    elif proposal.action == "ok":
        message = f"champion v{proposal.champion_version} holds up: " + "; ".join(proposal.reasons)
    elif proposal.action == "no_champion":
        message = proposal.reasons[0]
    else:
        message = f"REGRESSED, nothing to roll back to: {'; '.join(proposal.reasons)}"
    outcome = WatchOutcome(decision=proposal.action, reasons=proposal.reasons, model=proposal.model,
                           rolled_back=bool(rolled_back), message=message)
    write_summary(key, outcome.to_json())
    if proposal.action == "regressed_no_fallback":
        raise PolicyError(f"champion v{proposal.champion_version} regressed and no version does better: "
                          + "; ".join(proposal.reasons))
    return outcome

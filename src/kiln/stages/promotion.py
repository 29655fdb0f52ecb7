"""Registration, the model gate, the review, promotion and how the run ended."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from kiln import runs
from kiln import settings as kiln_settings
from kiln.errors import RunMismatchError
from kiln.policy import Policy
from kiln.refs import (
    ApprovalAnswer,
    DataGateResult,
    Decision,
    EvalReport,
    PinnedMixture,
    PinnedSnapshot,
    PromotionRecord,
    RegisteredCandidate,
    Review,
    ReviewOutcome,
    RunOutcome,
    SnapshotRef,
    TrainingManifest,
    TrainResult,
    canonical_json,
    sha256_file,
)
from kiln.runs import run_dir
from kiln.stages.records import (
    own_eval_report,
    own_train_result,
    own_training_manifest,
    recorded_snapshot,
    refuse_a_disagreeing_xcom,
)
from kiln.util.fs import atomic_write_text, read_own_json


def register_stage(
    policy: Policy, snapshot: PinnedSnapshot | PinnedMixture, data: DataGateResult, train: TrainResult,
    evaluation: EvalReport, key: str, lineage: dict[str, str],
) -> RegisteredCandidate:
    """Register run ``key``'s checkpoint as a candidate version (``kiln.registry.register_candidate``)
    from the run's own records: its training manifest, quarantine report, training result and
    evaluation, and kiln's pinned snapshot. ``snapshot``, ``data``, ``train`` and ``evaluation`` (the
    upstream XComs) that disagree with those records are refused before any request to MLflow.
    ``lineage``: more tags for the version."""
    from kiln.registry import RunRecords, register_candidate

    manifest_path, manifest = own_training_manifest(key, data)
    refuse_a_disagreeing_xcom("snapshot", key, manifest_path, {"id": manifest.snapshot_id}, snapshot, ("id",))
    report_path = run_dir(key) / runs.QUARANTINE_JSON
    quarantine = _own_report(key, report_path)
    own_train = own_train_result(key, train)
    if manifest.sources:  # a mixture: its lineage per source, from the run's own records
        pinned, sources = mixture_lineage(key, manifest)
        rate = _mixture_quarantine_rate(sources)
        suites = canonical_json([[src["name"], src["contract_suite_sha256"]] for src in sources])
        suite_sha256 = hashlib.sha256(suites).hexdigest() if all(src["contract_suite_sha256"] for src in sources) else ""
    else:
        pinned, sources = recorded_snapshot(manifest.snapshot_id), ()
        rate = float(quarantine["quarantined_share"])
        suite_sha256 = str(quarantine.get("contract_sha256") or "")
    candidate = register_candidate(
        policy=policy,
        train=own_train,
        eval_report=own_eval_report(key, evaluation),
        snapshot=pinned,
        manifest=manifest,
        run_key=key,
        lineage={
            "quarantine_report": str(report_path),
            "quarantine_rate": str(round(rate, 4)),
            **lineage,
        },
        # For the signed provenance statement: the quarantine report and the contract suite's sha256
        # the data gate recorded in it (a mixture's: of its sources' suites, each also listed with its
        # source). Nodes and the run's start and end are not recorded by the stages yet; the statement
        # says so.
        records=RunRecords(quarantine_report=str(report_path), launcher=policy.launcher,
                           contract_suite_sha256=suite_sha256, sources=sources),
    )
    ui = kiln_settings.load().mlflow_uri
    return RegisteredCandidate.from_json(
        {**candidate, "ui_url": f"{ui}/#/models/{candidate['model_name']}/versions/{candidate['version']}"})


def _own_report(key: str, path: Path) -> dict[str, Any]:
    try:
        body = read_own_json(path)
    except (OSError, ValueError) as exc:
        raise RunMismatchError(f"run {key} has no readable quarantine report {path}: {exc}") from exc
    if not isinstance(body, dict):
        raise RunMismatchError(f"run {key}'s quarantine report {path} is not a JSON object")
    return body


def mixture_lineage(key: str, manifest: TrainingManifest) -> tuple[SnapshotRef, tuple[dict[str, Any], ...]]:
    """A mixture run's lineage from its own records: the set of snapshots as one ``SnapshotRef`` (its id
    and corpus as the manifest names them, ``dvc`` each source's ``.dvc`` text as JSON), and each source
    as the statement and the tags record it (``SOURCE_LINEAGE_KEYS``): its snapshot as kiln pinned it,
    its quarantine report (``sources/<name>/``), its packed tokens, its caps (``SOURCE_CAP_KEYS``, as its
    training manifest entry has them), and the samples and tokens training drew of it (``result.json``'s
    ``mixture``)."""
    from kiln.provenance.statement import SOURCE_CAP_KEYS
    from kiln.stages.mixture import SOURCES_SUBDIR

    assert manifest.sources is not None
    result_path = run_dir(key) / runs.TRAIN_SUBDIR / runs.RESULT_FILE
    drawn = {entry.get("name"): entry for entry in (_own_report(key, result_path).get("mixture") or [])
             if isinstance(entry, dict)}
    snapshots, sources = [], []
    for src in manifest.sources:
        name = src["name"]
        if name not in drawn:
            raise RunMismatchError(f"run {key}'s training result {result_path} reports no draw of source {name!r}")
        snap = recorded_snapshot(src["snapshot_id"])
        snapshots.append((name, snap))
        report_path = run_dir(key) / SOURCES_SUBDIR / name / runs.QUARANTINE_JSON
        report = _own_report(key, report_path)
        tokens = src.get("tokens") or {}
        sources.append({
            "name": name, "weight": src["weight"], "corpus": src["corpus"], "snapshot_id": src["snapshot_id"],
            "snapshot_remote": snap.remote, "snapshot_path": snap.path, "contract": src["contract"],
            "contract_suite_sha256": str(report.get("contract_sha256") or ""),
            "quarantine_report_sha256": sha256_file(report_path), "quarantine_report_uri": str(report_path),
            "max_quarantine_share": report.get("max_quarantine_share"),
            "quarantined_share": float(report.get("quarantined_share", 0.0)), "shards": int(report.get("shards", 0)),
            "token_manifest_sha256": str(tokens.get("sha256", "")), "token_manifest_uri": str(tokens.get("manifest", "")),
            "tokens": int(drawn[name].get("tokens", 0)), "share": float(drawn[name].get("share", 0.0)),
            **{cap: int(src[cap]) for cap in SOURCE_CAP_KEYS if src.get(cap) is not None},
        })
    joined = SnapshotRef(id=manifest.snapshot_id, corpus=manifest.corpus, files=sum(s.files for _, s in snapshots),
                         bytes=sum(s.bytes for _, s in snapshots),
                         dvc=json.dumps({name: s.dvc for name, s in snapshots}, sort_keys=True),
                         remote=",".join(sorted({s.remote for _, s in snapshots})), path="")
    return joined, tuple(sources)


def _mixture_quarantine_rate(sources: tuple[dict[str, Any], ...]) -> float:
    shards = sum(src["shards"] for src in sources)
    return sum(src["quarantined_share"] * src["shards"] for src in sources) / shards if shards else 1.0


def model_gate_stage(candidate: RegisteredCandidate) -> Decision:
    """The promotion decision (a value, not an error): the one ``decide`` made against the champion
    when the candidate was registered, and that is tagged on its model version."""
    return candidate.decision


def promote_stage(policy: Policy, candidate: RegisteredCandidate, decision: Decision, key: str) -> PromotionRecord:
    """Promote run ``key``'s candidate. Neither the approval nor the gate's verdict is taken from the
    arguments: the registry reads the review this run's approval task recorded on the candidate
    (refused without one, under a policy that requires approval) and the decision its registration
    recorded there; ``decision`` (the model gate's XCom) that says otherwise is refused. A re-run
    after a rollback of this version is refused by the registry."""
    from kiln.registry import promote

    return promote(policy=policy, candidate_version=candidate.version, decision=decision, run_key=key)


def review_in_words(policy: Policy, answer: ApprovalAnswer) -> tuple[ReviewOutcome, str, str]:
    """An approval task's answer (chosen options, responder, time, timed out) as kiln records it:
    ``(outcome, reviewer, at)``. Pure. The responder is named as the policy lists its reviewers
    (by name, else by id: FAB's ids are row numbers); a timeout names who was asked."""
    at = answer.responded_at
    if answer.timed_out:
        return "timed out", f"nobody (assigned: {', '.join(policy.reviewers)})", at
    user = answer.responded_by_user
    name, user_id = str(user.get("name") or ""), str(user.get("id") or "")
    reviewer = next((u for u in (name, user_id) if u and u in policy.reviewers), name or user_id or "unknown")
    return ("approved" if answer.chosen_options == ["Approve"] else "rejected"), reviewer, at


def review_stage(policy: Policy, candidate: RegisteredCandidate, answer: ApprovalAnswer, key: str) -> Review:
    """Record run ``key``'s review of its candidate: called inside the approval task, with the answer
    Airflow handed it, this is the one approval ``promote_stage`` accepts. An Approve from someone
    who is not a reviewer, or for another run's version, is refused (``PolicyError``)."""
    from kiln.registry import record_review

    outcome, reviewer, at = review_in_words(policy, answer)
    return record_review(policy=policy, candidate_version=candidate.version, run_key=key, outcome=outcome,
                         reviewer=reviewer, at=at, comment=answer.comment or "")


def outcome_stage(
    policy: Policy, candidate: RegisteredCandidate, promotion: PromotionRecord | None, key: str,
) -> RunOutcome:
    """Say how the run ended for the model: promoted (where, by whom) or not (and why); also the
    run's ``summary.json``.

    The review is told as the registry recorded it for this run (not as an XCom says it was).
    """
    decision = candidate.decision
    review = None
    if policy.requires_approval and decision.action == "promote":
        from kiln.registry import recorded_review

        review = recorded_review(policy, candidate.version, key)
    if promotion is not None:
        message = (f"promoted {candidate.model_name} v{candidate.version} to "
                   f"{promotion.registered_model}@{promotion.alias} (version {promotion.version})")
    elif decision.action != "promote":
        message = f"NOT promoted: the model gate said hold: {'; '.join(decision.reasons)}"
    elif review is not None and review.outcome == "timed out":
        message = (f"NOT promoted: the review timed out: {review.reviewer} answered within "
                   f"{policy.approval_timeout_s} s, so the default (Reject) applied")
    elif review is not None:
        message = f"NOT promoted: the review was {review.outcome} by {review.reviewer}"
    else:
        message = "NOT promoted: no review of this candidate is recorded in the registry for this run"
    training = _training_in_words(key)
    if training:
        message = f"{message}; training: {training}"
    outcome = RunOutcome(
        candidate_model=candidate.model_name, candidate_version=candidate.version, decision=decision.action,
        decision_reasons=decision.reasons, promoted=promotion is not None, message=message,
    )
    if review is not None:
        outcome = dataclasses.replace(outcome, review=review.outcome, reviewer=review.reviewer, reviewed_at=review.at,
                                      review_comment=review.comment)
    if promotion is not None:
        outcome = dataclasses.replace(outcome, model=promotion.registered_model, version=promotion.version,
                                      alias=promotion.alias, approver=promotion.approver)
    write_summary(key, outcome.to_json())
    return outcome


def _training_in_words(key: str) -> str:
    """What happened to the run's training that its model does not show: each elastic shrink (a lost
    node, not replaced in time; the job went on with fewer), as its launcher recorded it, or ""."""
    from kiln.launchers.elastic import shrinks_for_status

    shrinks = shrinks_for_status(run_dir(key) / runs.TRAIN_SUBDIR)
    return f"elastic shrink: {'; '.join(shrinks)}" if shrinks else ""


def write_summary(key: str, summary: dict[str, Any]) -> Path:
    """The run's outcome in its own directory (``summary.json``), with the run it is about."""
    dag_id, run_id = runs.split_run_key(key)
    body = {**summary, "dag_id": dag_id, "run_id": run_id}
    return atomic_write_text(run_dir(key) / runs.SUMMARY, json.dumps(body, indent=2, sort_keys=True, default=str) + "\n")
